#!/usr/bin/env python3
"""Validate a Prometheus text exposition without promtool (the fallback of CI).

    .venv/bin/python deploy/tools/check_metrics.py scrape.txt      (or - for stdin)

Checks, in the spirit of ``promtool check metrics`` (its promlint rules) plus the
sidecar's contract (``interface.md``, "Metrics"):

* the text parses (``prometheus_client.parser``), with a ``# TYPE`` for every family
  and no series twice;
* every family has a non-empty ``# HELP``;
* counters end in ``_total``, and nothing else does;
* ``_count``/``_sum``/``_bucket`` suffixes only on histograms and summaries;
* base units only (``seconds``, ``bytes``; no ``milliseconds``, ``_ms``, ``kb``,
  ``percent`` ...), no type name in a metric name, snake_case names and labels,
  no ``:`` (reserved for recording rules), no ``__`` label names;
* histograms: ``le`` ascending and ending in ``+Inf``, cumulative counts
  non-decreasing, ``_count`` equal to the ``+Inf`` bucket, a ``_sum``;
* the contract: each ``sidecar_*`` family of :data:`CONTRACT` is there with its
  type and exactly its label names; any other ``sidecar_*`` family is listed in
  :data:`EXTRA` or (present only with ``[fleet]``) :data:`FLEET`, or (only with
  ``[tracing]``) :data:`TRACING`.

Prints one line per problem and exits 1 if there is any, else prints a summary
and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import sys
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

CONTRACT: dict[str, tuple[str, frozenset[str]]] = {
    "sidecar_requests_total": ("counter", frozenset({"route", "code"})),
    "sidecar_request_duration_seconds": ("histogram", frozenset({"route"})),
    "sidecar_upstream_attempts_total": ("counter", frozenset({"upstream", "model", "outcome"})),
    "sidecar_upstream_first_byte_seconds": ("histogram", frozenset({"upstream", "model"})),
    "sidecar_retries_total": ("counter", frozenset({"upstream", "model"})),
    "sidecar_fallbacks_total": ("counter", frozenset({"route", "upstream", "reason"})),
    "sidecar_breaker_state": ("gauge", frozenset({"upstream", "model", "state"})),
    "sidecar_breaker_transitions_total": ("counter", frozenset({"upstream", "model", "to"})),
    "sidecar_breaker_rejections_total": ("counter", frozenset({"upstream", "model"})),
    "sidecar_inflight_requests": ("gauge", frozenset()),
    "sidecar_slow_calls_total": ("counter", frozenset({"upstream", "model"})),
}
"""The contract's metrics table: name -> (type, label names)."""

EXTRA: dict[str, tuple[str, frozenset[str]]] = {
    "sidecar_config_reloads_total": ("counter", frozenset({"result"})),
    "sidecar_stream_aborts_total": ("counter", frozenset({"upstream", "model", "reason"})),
    # In the contract's table; samples only after a ramping recovery (test_ramp_e2e.py).
    "sidecar_ramp_skips_total": ("counter", frozenset({"upstream", "model"})),
    # In the contract's table; samples only on a route with affinity_header
    # (test_affinity_e2e.py).
    "sidecar_affinity_total": ("counter", frozenset({"route", "result"})),
    # In the contract's table; samples only once a retry was skipped (test_retry_budget.py).
    "sidecar_retries_skipped_total": ("counter", frozenset({"upstream", "model", "reason"})),
    # In the contract's table; samples only on a route with hedge_after_ms (test_hedge.py).
    "sidecar_hedges_total": ("counter", frozenset({"route", "result"})),
    # In the contract's table; samples only once an operator overrode a breaker
    # (tests/e2e/test_overrides.py).
    "sidecar_breaker_overrides_total": ("counter", frozenset({"upstream", "model", "action"})),
    # An addition to the contract (docs/overrides.md): 1 while an override is in force.
    "sidecar_breaker_override_active": ("gauge", frozenset({"upstream", "model", "action"})),
    "sidecar_tokens_total": (
        "counter",
        frozenset({"route", "upstream", "model", "kind", "relayed"}),
    ),
}
"""``sidecar_*`` metrics beyond the table (documented in docs/metrics.md)."""

FLEET: dict[str, tuple[str, frozenset[str]]] = {
    "sidecar_fleet_store_up": ("gauge", frozenset()),
    "sidecar_fleet_syncs_total": ("counter", frozenset({"result"})),
}
"""The contract's metrics that exist only with ``[fleet]``: checked when present."""

TRACING: dict[str, tuple[str, frozenset[str]]] = {
    "sidecar_trace_spans_dropped_total": ("counter", frozenset()),
}
"""The contract's metric that exists only with ``[tracing]``: checked when present."""

NON_BASE_UNITS = {
    "milliseconds": "seconds",
    "microseconds": "seconds",
    "nanoseconds": "seconds",
    "minutes": "seconds",
    "hours": "seconds",
    "days": "seconds",
    "weeks": "seconds",
    "kilobytes": "bytes",
    "megabytes": "bytes",
    "gigabytes": "bytes",
    "terabytes": "bytes",
    "kibibytes": "bytes",
    "mebibytes": "bytes",
    "gibibytes": "bytes",
    "percent": "ratio",
}
"""Units promlint rejects, with the base unit to use."""

UNIT_ABBREVIATIONS = frozenset(
    {"ms", "us", "ns", "sec", "secs", "min", "mins", "hr", "hrs", "kb", "mb", "gb", "tb", "pct"}
)
TYPE_WORDS = frozenset({"counter", "gauge", "histogram", "summary"})
RESERVED_SUFFIXES = ("_count", "_sum", "_bucket")
NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
SNAKE_RE = re.compile(r"^[a-z_][a-z0-9_]*$")


class Exposition:
    """TYPE and HELP lines of a text exposition, and its parsed samples."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.helps: dict[str, str] = {}
        self.problems: list[str] = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.startswith("# TYPE "):
                parts = line.split(" ")
                if len(parts) != 4:
                    self.problems.append(f"line {n}: malformed TYPE line: {line!r}")
                    continue
                if parts[2] in self.types:
                    self.problems.append(f"{parts[2]}: TYPE given twice")
                self.types[parts[2]] = parts[3]
            elif line.startswith("# HELP "):
                name, _, help_ = line[len("# HELP ") :].partition(" ")
                self.helps[name] = help_
        # sample name, labels, value, family name as in the TYPE line
        self.samples: list[tuple[str, dict[str, str], float, str]] = []
        try:
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    self.samples.append((s.name, dict(s.labels), float(s.value), family.name))
        except ValueError as exc:
            self.problems.append(f"does not parse: {exc}")

    def family_of(self, sample_name: str) -> str | None:
        """The TYPE-line family a sample belongs to."""
        if sample_name in self.types:
            return sample_name
        for suffix in (*RESERVED_SUFFIXES, "_created"):
            base = sample_name.removesuffix(suffix)
            if base != sample_name and self.types.get(base) in ("histogram", "summary"):
                return base
        return None


def lint_name(name: str, kind: str) -> list[str]:
    """promlint-style problems of one family name."""
    out: list[str] = []
    if not NAME_RE.match(name):
        out.append(f"{name}: invalid metric name" + (" (':' is for rules)" if ":" in name else ""))
    elif not SNAKE_RE.match(name):
        out.append(f"{name}: metric names should be snake_case, not camelCase")
    if kind == "counter" and not name.endswith("_total"):
        out.append(f'{name}: counter metrics should have "_total" suffix')
    if kind != "counter" and name.endswith("_total"):
        out.append(f'{name}: only counters end in "_total" (this is a {kind})')
    if kind not in ("histogram", "summary") and name.endswith(RESERVED_SUFFIXES):
        out.append(f"{name}: _count/_sum/_bucket are reserved for histograms and summaries")
    words = name.split("_")
    for word in words:
        if word in NON_BASE_UNITS:
            out.append(f"{name}: use base unit {NON_BASE_UNITS[word]!r} instead of {word!r}")
        if word in UNIT_ABBREVIATIONS:
            out.append(f"{name}: metric names should not contain abbreviated units ({word!r})")
    for word in sorted(TYPE_WORDS & set(words)):
        out.append(f"{name}: metric name should not include type {word!r}")
    return out


def check_histograms(expo: Exposition, out: list[str]) -> None:
    """Bucket order, cumulativeness, +Inf == _count, a _sum, per series."""
    buckets: dict[tuple[str, frozenset[tuple[str, str]]], list[tuple[float, float]]] = defaultdict(
        list
    )
    counts: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    sums: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for name, sample_labels, value, _ in expo.samples:
        family = expo.family_of(name)
        if family is None or expo.types.get(family) != "histogram":
            continue
        labels = {k: v for k, v in sample_labels.items() if k != "le"}
        key = (family, frozenset(labels.items()))
        if name.endswith("_bucket"):
            if "le" not in sample_labels:
                out.append(f"{name}{labels}: bucket without le")
                continue
            buckets[key].append((float(sample_labels["le"]), value))
        elif name.endswith("_count"):
            counts[key] = value
        elif name.endswith("_sum"):
            sums.add(key)
    for key, series in buckets.items():
        where = f"{key[0]}{dict(key[1])}"
        les = [le for le, _ in series]
        if les != sorted(les) or len(set(les)) != len(les):
            out.append(f"{where}: bucket bounds not strictly ascending")
        if not les or les[-1] != math.inf:
            out.append(f"{where}: no +Inf bucket")
        values = [v for _, v in series]
        if any(b < a for a, b in itertools.pairwise(values)):
            out.append(f"{where}: bucket counts are not cumulative")
        if key not in counts or (les and counts[key] != values[-1]):
            out.append(f"{where}: _count differs from the +Inf bucket")
        if key not in sums:
            out.append(f"{where}: no _sum")


def check_contract(expo: Exposition, out: list[str]) -> None:
    """The sidecar's families: present, typed and labelled as the contract says."""
    labels_seen: dict[str, set[frozenset[str]]] = defaultdict(set)
    for name, sample_labels, _, _ in expo.samples:
        family = expo.family_of(name)
        if family is not None:
            labels_seen[family].add(frozenset(set(sample_labels) - {"le"}))
    expected = {**CONTRACT, **EXTRA, **FLEET, **TRACING}
    for name in sorted(n for n in expo.types if n.startswith("sidecar_")):
        if name not in expected:
            out.append(f"{name}: a sidecar_* metric not in the contract (nor in EXTRA)")
    for name, (kind, label_names) in expected.items():
        if name not in expo.types:
            if name in CONTRACT:
                out.append(f"{name}: missing (contract)")
            continue
        if expo.types[name] != kind:
            out.append(f"{name}: type {expo.types[name]}, the contract says {kind}")
        for seen in labels_seen.get(name, set()):
            if seen != label_names:
                want = sorted(label_names)
                out.append(f"{name}: labels {sorted(seen)}, the contract says {want}")
        if name in CONTRACT and not labels_seen.get(name):
            out.append(f"{name}: no samples (the scrape should exercise every metric)")


def check(text: str, *, contract: bool = True) -> tuple[list[str], int, int]:
    """All problems of ``text``; with the number of families and samples."""
    expo = Exposition(text)
    out = list(expo.problems)
    for name, kind in sorted(expo.types.items()):
        if not expo.helps.get(name, "").strip():
            out.append(f"{name}: no help text")
        out.extend(lint_name(name, kind))
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for name, labels, _, _ in expo.samples:
        key = (name, frozenset(labels.items()))
        if key in seen:
            out.append(f"{name}{labels}: series given twice")
        seen.add(key)
        if expo.family_of(name) is None:
            out.append(f"{name}: sample without a TYPE line for its family")
        for label in labels:
            if not SNAKE_RE.match(label):
                out.append(f"{name}: label names should be snake_case ({label!r})")
            if label.startswith("__"):
                out.append(f"{name}: label names starting with __ are reserved ({label!r})")
    check_histograms(expo, out)
    if contract:
        check_contract(expo, out)
    return out, len(expo.types), len(expo.samples)


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", help="a /metrics scrape (- for stdin)")
    parser.add_argument(
        "--no-contract", action="store_true", help="only the generic exposition rules"
    )
    args = parser.parse_args(argv)
    if args.file == "-":
        text = sys.stdin.read()
    else:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    problems, families, samples = check(text, contract=not args.no_contract)
    for p in problems:
        print(f"check_metrics: {p}")
    if problems:
        print(f"check_metrics: {len(problems)} problem(s)")
        return 1
    print(f"check_metrics: OK, {families} families, {samples} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())

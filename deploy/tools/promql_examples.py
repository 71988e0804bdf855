#!/usr/bin/env python3
"""Every PromQL example of the docs, as a ``promtool test rules`` file on a real scrape.

    .venv/bin/python deploy/tools/scrape_metrics.py --out scrape.txt
    .venv/bin/python deploy/tools/promql_examples.py scrape.txt OUTDIR
    promtool test rules OUTDIR/promql-examples.test.json

The examples are the fenced ```` ```promql ```` blocks of ``README.md`` and
``docs/metrics.md``: in a block, a line starting with ``#`` (a comment) or a blank
line ends an expression, an indented line continues the one above, any other line
starts a new one.

The input series are the scrape's ``sidecar_*`` samples, each with the labels
``namespace="ns", pod="a"`` added as a Kubernetes scrape would, sampled every 15
seconds (the PodMonitor's interval): counters (and histogram
``_bucket``/``_count``/``_sum`` series) grow by their scraped value every minute
for 20 minutes, gauges keep their scraped value. The recording rules of
``deploy/prometheus/sidecar-rules.yaml`` are loaded, so an example may use the
series they record. Each example must give at least one series at 20m
(``count(EXAMPLE) > bool 0`` equals 1): an example that names a metric or label
the sidecar does not expose, divides series whose labels do not match, or does
not parse, fails. The output is JSON, which is YAML for promtool. Prints one line
per example to stdout.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = ("README.md", "docs/metrics.md")
TEST_FILE = "promql-examples.test.json"
MINUTES = 20
STEPS_PER_MINUTE = 4
"""Samples a minute (every 15 s): a rule's ``rate(...[1m])`` sees several."""
RECORDING_RULES = ROOT / "deploy" / "prometheus" / "sidecar-rules.yaml"
"""The recording rules the examples may use (absolute: the test file is written elsewhere)."""
EXTRA_LABELS = {"namespace": "ns", "pod": "a"}
FENCE_RE = re.compile(r"^```(\w*)\s*$")


def examples(text: str, where: str) -> Iterator[tuple[str, str]]:
    """``(where:line, expression)`` for every expression of the ``promql`` blocks of ``text``."""
    in_block = False
    current: list[str] = []
    start = 0

    def flush() -> Iterator[tuple[str, str]]:
        if current:
            yield f"{where}:{start}", " ".join(s.strip() for s in current)
            current.clear()

    for n, line in enumerate(text.splitlines(), 1):
        fence = FENCE_RE.match(line)
        if fence:
            if in_block:
                yield from flush()
            in_block = not in_block and fence.group(1) == "promql"
            continue
        if not in_block:
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            yield from flush()
        elif line[0].isspace() and current:
            current.append(line)
        else:
            yield from flush()
            current.append(line)
            start = n


def series_label(name: str, labels: dict[str, str]) -> str:
    """``name{k="v",...}`` in PromQL's series notation, values escaped."""
    merged = {**labels, **EXTRA_LABELS}
    body = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(merged.items()))
    return f"{name}{{{body}}}"


def input_series(scrape: str) -> list[dict[str, str]]:
    """promtool ``input_series`` from the ``sidecar_*`` samples of a scrape (see the docstring)."""
    out: list[dict[str, str]] = []
    for fam in text_string_to_metric_families(scrape):
        if not fam.name.startswith("sidecar_"):
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            steps = MINUTES * STEPS_PER_MINUTE
            growing = fam.type in ("counter", "histogram", "summary")
            if growing:
                values = f"0+{float(s.value) / STEPS_PER_MINUTE!r}x{steps}"
            else:
                values = f"{float(s.value)!r}x{steps}"
            out.append({"series": series_label(s.name, dict(s.labels)), "values": values})
    return out


def rules_test(scrape: str, found: list[tuple[str, str]]) -> dict[str, object]:
    """The promtool unit-test document: one ``promql_expr_test`` per example."""
    return {
        "rule_files": [str(RECORDING_RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": f"{60 // STEPS_PER_MINUTE}s",
                "input_series": input_series(scrape),
                "promql_expr_test": [
                    {
                        "expr": f"count(({expr})) > bool 0",
                        "eval_time": f"{MINUTES}m",
                        "exp_samples": [{"labels": "{}", "value": 1}],
                    }
                    for _, expr in found
                ],
            }
        ],
    }


def all_examples(root: Path = ROOT) -> list[tuple[str, str]]:
    """Every example of :data:`DOCS` under ``root``, in order."""
    found: list[tuple[str, str]] = []
    for doc in DOCS:
        found.extend(examples((root / doc).read_text(encoding="utf-8"), doc))
    return found


def main(argv: list[str]) -> int:
    """``promql_examples.py SCRAPE OUTDIR``: write OUTDIR/promql-examples.test.json."""
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    scrape, outdir = Path(argv[0]).read_text(encoding="utf-8"), Path(argv[1])
    found = all_examples()
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / TEST_FILE).write_text(json.dumps(rules_test(scrape, found), indent=1))
    for where, expr in found:
        print(f"  {where}: {expr}")
    print(f"promql_examples: {len(found)} examples -> {outdir / TEST_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

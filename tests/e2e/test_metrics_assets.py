"""The monitoring assets against the metrics the sidecar really exposes.

* ``deploy/grafana/sidecar-dashboard.json``: parses, is a well-formed dashboard,
  every PromQL expression names only exposed metrics, with labels (matchers,
  ``by``/``on`` lists, legends) and label values those metrics have, and it shows
  what an operator needs (breaker state over time, openings, rejections,
  fallbacks, attempts by outcome, first-byte quantiles, requests by code, in-flight).
* ``deploy/prometheus/sidecar-alerts.yaml`` (and its promtool unit tests): the same
  checks on every alert expression and the labels its annotations use.
* ``deploy/tools/check_metrics.py`` (CI's exposition check without promtool):
  passes a real scrape and catches each rule it claims to check.

Exposed names come from a live ``/metrics`` scrape; label names from the
contract's table (``tests/e2e/test_metrics.py`` checks that table against the
exposition).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]

from sidecar.testing import FakeUpstream
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar
from tests.deploy_tools import load_tool
from tests.e2e.test_metrics import CONTRACT, EXTRA, LABEL_VALUES, Scrape, scrape

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "sidecar-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "sidecar-alerts.yaml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "sidecar-alerts.test.yaml"

TARGET_LABELS = frozenset({"namespace", "pod", "job", "instance", "container"})
"""Labels Prometheus adds at scrape time (kubernetes_sd / PodMonitor, static configs)."""

EXPECTED_ALERTS = {
    "SidecarBreakerOpen",
    "SidecarBreakerFlapping",
    "SidecarHighFallbackRate",
    "SidecarUpstreamErrorRatio",
    "SidecarConfigReloadFailed",
}


# -- a small PromQL reader --------------------------------------------------------------

AGGREGATIONS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    }
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
OPERATOR_WORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
NUMBER = re.compile(r"(?:0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)[a-zA-Z]*")
MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


class Query:
    """What one PromQL expression references."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.selectors: list[tuple[str, list[tuple[str, str, str]]]] = []
        self.grouping: set[str] = set()
        self.functions: set[str] = set()
        self.problems: list[str] = []
        self._read(expr)

    @property
    def metrics(self) -> set[str]:
        return {name for name, _ in self.selectors}

    def _read(self, s: str) -> None:
        i, n = 0, len(s)
        while i < n:
            c = s[i]
            if c in "\"'`":
                i = _skip_string(s, i)
            elif c == "[":
                i = s.index("]", i) + 1
            elif c == "{":  # a selector with no metric name
                end = s.index("}", i)
                self.selectors.append(("", self._matchers(s[i + 1 : end])))
                i = end + 1
            elif c == "$":
                m = IDENT.match(s, i + 1)
                i = m.end() if m else i + 1
            elif (m := NUMBER.match(s, i)) and m.end() > i and (c.isdigit() or c == "."):
                i = m.end()
            elif m := IDENT.match(s, i):
                word, i = m.group(), m.end()
                k = i
                while k < n and s[k].isspace():
                    k += 1
                if word in GROUPING:
                    if k < n and s[k] == "(":
                        end = s.index(")", k)
                        labels = [x.strip() for x in s[k + 1 : end].split(",") if x.strip()]
                        self.grouping.update(labels)
                        i = end + 1
                elif word.lower() in OPERATOR_WORDS:
                    pass
                elif word in AGGREGATIONS or (k < n and s[k] == "("):
                    self.functions.add(word)
                else:
                    matchers: list[tuple[str, str, str]] = []
                    if k < n and s[k] == "{":
                        end = s.index("}", k)
                        matchers = self._matchers(s[k + 1 : end])
                        i = end + 1
                    self.selectors.append((word, matchers))
            else:
                i += 1

    def _matchers(self, body: str) -> list[tuple[str, str, str]]:
        out: list[tuple[str, str, str]] = []
        pos = 0
        body = body.strip()
        while pos < len(body):
            m = MATCHER.match(body, pos)
            if m is None or m.end() == pos:
                self.problems.append(f"cannot read label matchers {body!r}")
                break
            out.append((m.group(1), m.group(2), m.group(3)))
            pos = m.end()
        return out


def _skip_string(s: str, i: int) -> int:
    quote, i = s[i], i + 1
    while s[i] != quote:
        i += 2 if s[i] == "\\" else 1
    return i + 1


def base_metric(series: str) -> str:
    """The contract metric a series name belongs to (histogram suffixes removed)."""
    for suffix in ("_bucket", "_count", "_sum"):
        base = series.removesuffix(suffix)
        if base != series and CONTRACT.get(base, ("",))[0] == "histogram":
            return base
    return series


def metric_labels(series: str) -> frozenset[str]:
    name = base_metric(series)
    labels = {**CONTRACT, **EXTRA}[name][1]
    return labels | ({"le"} if series.endswith("_bucket") else set())


def check_query(q: Query, exposed: set[str]) -> list[str]:
    """Problems of one expression: unknown metrics, labels or label values."""
    out = list(q.problems)
    known: set[str] = set()
    for name, matchers in q.selectors:
        if not name:
            out.append("a selector without a metric name")
            continue
        if name not in exposed:
            out.append(f"{name}: not exposed by the sidecar")
            continue
        labels = metric_labels(name)
        known |= labels
        for label, op, value in matchers:
            if label not in labels | TARGET_LABELS:
                out.append(f"{name}: no label {label!r}")
            allowed = LABEL_VALUES.get((base_metric(name), label))
            if allowed is None or "$" in value:
                continue
            values = value.split("|") if op in ("=~", "!~") else [value]
            for v in values:
                if re.fullmatch(r"[a-z0-9_]+", v) and v not in allowed:
                    out.append(f"{name}: {label}={v!r} is never exposed")
    for label in q.grouping - known - TARGET_LABELS:
        out.append(f"grouping by {label!r}, a label none of {sorted(q.metrics)} has")
    return out


def test_query_reader_sees_metrics_labels_and_values() -> None:
    """The reader itself: a reader that found nothing would pass every asset."""
    q = Query(
        "histogram_quantile(0.99, sum by (upstream, le) (rate(sidecar_upstream_first_byte_"
        'seconds_bucket{namespace=~"$ns", model!="*"}[$__rate_interval]))) > 0.5 and on (upstream)'
        ' sum(sidecar_breaker_state{state="open"}) offset 5m'
    )
    assert q.metrics == {"sidecar_upstream_first_byte_seconds_bucket", "sidecar_breaker_state"}
    assert q.grouping == {"upstream", "le"}
    assert {"histogram_quantile", "sum", "rate"} <= q.functions
    exposed = {"sidecar_upstream_first_byte_seconds_bucket", "sidecar_breaker_state"}
    assert check_query(q, exposed) == []
    bad = Query(
        'sum by (upstrem) (rate(sidecar_retries_total{modle="x"}[5m]))'
        ' + sidecar_breaker_state{state="opened"} + sidecar_nope_total'
    )
    problems = check_query(bad, {"sidecar_retries_total", "sidecar_breaker_state"})
    assert any("no label 'modle'" in p for p in problems)
    assert any("'opened' is never exposed" in p for p in problems)
    assert any("sidecar_nope_total: not exposed" in p for p in problems)
    assert any("grouping by 'upstrem'" in p for p in problems)


# -- what is exposed ----------------------------------------------------------------------


@pytest.fixture
async def exposed(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> set[str]:
    """Every series name the sidecar's ``/metrics`` declares (histogram suffixes included)."""
    sc = await start_sidecar(
        config(
            upstreams={"as_a": upstream(fake.url)},
            routes=[route("as_chat", "as_a", path_prefix="/")],
        )
    )
    s = await scrape(http, sc)
    names: set[str] = set()
    for name, kind in s.types.items():
        if not name.startswith("sidecar_"):
            continue
        names.add(name)
        if kind == "histogram":
            names.update(f"{name}{x}" for x in ("_bucket", "_count", "_sum"))
    assert set(CONTRACT) <= names
    return names


# -- the dashboard ------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    with DASHBOARD.open(encoding="utf-8") as f:
        doc = json.load(f)
    assert isinstance(doc, dict)
    return doc


def all_panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from all_panels(p.get("panels", []))


def test_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    d = load_dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = list(all_panels(d["panels"]))
    assert len(panels) >= 8
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        assert p["type"] in {"timeseries", "stat", "state-timeline", "gauge", "row", "table"}
        assert p["title"], p
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            assert t["datasource"] == p["datasource"], p["title"]


async def test_dashboard_queries_use_only_exposed_metrics_and_labels(exposed: set[str]) -> None:
    d = load_dashboard()
    exprs = load_tool("dashboard_exprs")
    problems: list[str] = []
    n = 0
    for where, expr in exprs.exprs(d):
        n += 1
        q = Query(expr)
        if not q.metrics:
            problems.append(f"{where}: no metric in {expr!r}")
        problems += [f"{where}: {p}" for p in check_query(q, exposed)]
    for p in all_panels(d["panels"]):
        for t in p.get("targets", []):
            q = Query(t["expr"])
            legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
            if q.functions & AGGREGATIONS:  # only the by (...) labels survive
                kept: set[str] | frozenset[str] = q.grouping
            else:
                kept = TARGET_LABELS.union(*(metric_labels(m) for m in q.metrics & exposed))
            if missing := legend_labels - kept:
                problems.append(f"{p['title']}: legend uses {sorted(missing)}, not kept")
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.match(r"label_values\((.+),\s*(\w+)\)$", v["query"]["query"])
            assert m, v["name"]
            assert m.group(2) in TARGET_LABELS | set().union(*(CONTRACT[x][1] for x in CONTRACT))
    assert n >= 10
    assert problems == []


def test_dashboard_shows_what_an_operator_needs() -> None:
    d = load_dashboard()
    queries = [(p, Query(t["expr"])) for p in all_panels(d["panels"]) for t in p.get("targets", [])]

    def has(metric: str, *, grouping: set[str] | None = None, func: str | None = None) -> bool:
        return any(
            metric in q.metrics
            and (grouping is None or grouping <= q.grouping)
            and (func is None or func in q.functions)
            for _, q in queries
        )

    state_panels = [p for p, q in queries if "sidecar_breaker_state" in q.metrics]
    assert any(p["type"] == "state-timeline" for p in state_panels), "breaker state over time"
    assert has("sidecar_breaker_state", grouping={"upstream", "model"})
    assert has("sidecar_breaker_transitions_total", grouping={"upstream", "model", "to"})
    assert has("sidecar_breaker_rejections_total", grouping={"upstream", "model"})
    assert has("sidecar_fallbacks_total", grouping={"route", "upstream", "reason"})
    assert has("sidecar_upstream_attempts_total", grouping={"upstream", "outcome"})
    assert has("sidecar_retries_total")
    quantiles = {
        q.expr.split("(", 1)[1].split(",", 1)[0].strip()
        for _, q in queries
        if "sidecar_upstream_first_byte_seconds_bucket" in q.metrics
        and "histogram_quantile" in q.functions
        and {"upstream", "le"} <= q.grouping
    }
    assert {"0.5", "0.9", "0.99"} <= quantiles
    assert has("sidecar_request_duration_seconds_bucket", func="histogram_quantile")
    assert has("sidecar_requests_total", grouping={"route", "code"})
    assert has("sidecar_inflight_requests")
    assert has("sidecar_config_reloads_total", grouping={"result"})
    shown = {base_metric(m) for _, q in queries for m in q.metrics}
    assert set(CONTRACT) <= shown, set(CONTRACT) - shown


# -- the alert rules ----------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def alert_rules() -> list[dict[str, Any]]:
    doc = load_yaml(ALERTS)
    assert list(doc) == ["groups"]
    rules: list[dict[str, Any]] = []
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        rules += group["rules"]
    return rules


async def test_alert_rules_use_only_exposed_metrics_and_labels(exposed: set[str]) -> None:
    rules = alert_rules()
    assert {r["alert"] for r in rules} == EXPECTED_ALERTS
    problems: list[str] = []
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert re.fullmatch(r"([0-9]+[smhdwy])+", r.get("for", "0s")), r["alert"]
        assert r["labels"]["severity"] in {"info", "warning", "critical"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        q = Query(r["expr"])
        assert q.metrics, r["alert"]
        problems += [f"{r['alert']}: {p}" for p in check_query(q, exposed)]
        text = " ".join(r["annotations"].values())
        for label in set(re.findall(r"\$labels\.(\w+)", text)) - q.grouping:
            problems.append(f"{r['alert']}: annotations use $labels.{label}, not kept by the expr")
    assert problems == []


def test_breaker_open_alert_looks_at_five_minutes_of_state() -> None:
    rule = next(r for r in alert_rules() if r["alert"] == "SidecarBreakerOpen")
    q = Query(rule["expr"])
    assert q.metrics == {"sidecar_breaker_state"}
    assert "[5m]" in rule["expr"] and "_over_time" in rule["expr"]


def test_every_alert_has_a_promtool_test_where_it_fires() -> None:
    doc = load_yaml(ALERT_TESTS)
    assert doc["rule_files"] == [ALERTS.name]
    firing = {
        case["alertname"]
        for test in doc["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert firing == EXPECTED_ALERTS


# -- CI's fallback exposition check --------------------------------------------------------


def test_check_metrics_tool_has_the_contract_table() -> None:
    tool = load_tool("check_metrics")
    assert tool.CONTRACT == CONTRACT
    assert tool.EXTRA == EXTRA


async def test_check_metrics_tool_passes_a_real_scrape_and_catches_each_rule() -> None:
    tool = load_tool("check_metrics")
    scraper = load_tool("scrape_metrics")
    text, problems = await scraper.scrape()
    assert problems == []
    s = Scrape(text)
    assert set(CONTRACT) <= {n for n, *_ in s.samples} | {base_metric(n) for n, *_ in s.samples}, (
        "the CI scrape must give every contract metric samples"
    )
    found, families, samples = tool.check(text)
    assert found == []
    assert families >= len(CONTRACT) and samples > 50

    def problems_of(mutated: str, **kw: bool) -> list[str]:
        assert mutated != text, "the mutation changed nothing"
        out: list[str] = tool.check(mutated, **kw)[0]
        return out

    cases = [
        (text.replace("sidecar_inflight_requests", "sidecar_inflight_requests_total"), "_total"),
        (re.sub(r"# HELP sidecar_retries_total .*\n", "", text), "no help"),
        (text.replace("sidecar_request_duration_seconds", "sidecar_request_duration_ms"), "ms"),
        (text.replace('le="+Inf"', 'le="999"'), "+Inf"),
        (text.replace('outcome="', 'result="'), "contract says"),
        (
            text.replace("# TYPE sidecar_breaker_state gauge", "# TYPE sidecar_breaker_state info"),
            "contract says gauge",
        ),
        (
            text + "# HELP sidecar_extra Extra\n# TYPE sidecar_extra gauge\nsidecar_extra 1\n",
            "not in",
        ),
    ]
    for mutated, needle in cases:
        got = problems_of(mutated)
        assert any(needle in p for p in got), (needle, got)
    counter = "# HELP fooBar_ms x\n# TYPE fooBar_ms counter\nfooBar_ms_total 1\n"
    got = problems_of(counter, contract=False)
    for needle in ('"_total" suffix', "snake_case", "abbreviated units"):
        assert any(needle in p for p in got), (needle, got)

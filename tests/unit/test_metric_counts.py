"""The plain-count families expose exactly what prometheus-client's own metrics would.

``sidecar.metric_counts`` replaces four prometheus-client metrics on the request
path; this feeds the same events to both into two fresh registries and compares
the whole exposition (text format and OpenMetrics), bucket bounds included.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from sidecar.metric_counts import CounterCounts, CountsCollector, HistogramCounts
from sidecar.metrics import LATENCY_BUCKETS

ROUTES = st.sampled_from(["chat", "anthropic", ""])
CODES = st.sampled_from(["200", "502", "429"])
SECONDS = st.one_of(
    st.sampled_from([0.0, *LATENCY_BUCKETS, 1e-9, 121.0, 1e6]),
    st.floats(min_value=0, max_value=200, allow_nan=False),
)


@given(
    counts=st.lists(st.tuples(ROUTES, CODES), max_size=12),
    observed=st.lists(st.tuples(ROUTES, SECONDS), max_size=12),
)
def test_same_exposition_as_prometheus_client(
    counts: list[tuple[str, str]], observed: list[tuple[str, float]]
) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("x_requests_total", "Requests", ["route", "code"], registry=theirs)
    hist = Histogram("x_seconds", "Time", ["route"], buckets=LATENCY_BUCKETS, registry=theirs)
    c = CounterCounts("x_requests_total", "Requests", ["route", "code"])
    h = HistogramCounts("x_seconds", "Time", ["route"], LATENCY_BUCKETS)
    ours.register(CountsCollector([c, h]))
    for route, code in counts:
        counter.labels(route, code).inc()
        c.cell(route, code)[0] += 1
    for route, seconds in observed:
        hist.labels(route).observe(seconds)
        h.observe(h.cell(route), seconds)
    assert generate_latest(ours).decode() == generate_latest(theirs).decode()
    assert om_latest(ours).decode() == om_latest(theirs).decode()  # type: ignore[no-untyped-call]

"""The per-request metrics as plain counts, turned into Prometheus samples at scrape time.

Four series move on every request: ``sidecar_requests_total``,
``sidecar_request_duration_seconds``, ``sidecar_upstream_attempts_total`` and
``sidecar_upstream_first_byte_seconds``. As prometheus-client metrics they cost
each request six locked value updates and a check per observation (py-spy,
JSON c=64: ~6 us of ~290). Here a request adds to a plain ``list`` cell (one
per label set, cached by the recorder; the loop's thread is the only writer),
and :class:`CountsCollector`, registered in prometheus-client's default registry,
builds the same families when ``/metrics`` is scraped: same names, help, types,
labels, bucket bounds (``le`` as prometheus-client writes it), series order
(first use) and values as the ``Counter`` / ``Histogram`` they replace.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterCounts:
    """One counter family: a ``[value]`` cell per label values, created on first use."""

    __slots__ = ("cells", "doc", "labels", "name")

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self.cells: dict[tuple[str, ...], list[float]] = {}

    def cell(self, *values: str) -> list[float]:
        """The cell of one label set (``cell[0] += 1`` counts one)."""
        c = self.cells.get(values)
        if c is None:
            c = self.cells[values] = [0.0]
        return c

    def family(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for values, c in list(self.cells.items()):
            fam.add_metric(values, c[0])
        return fam


class HistogramCounts:
    """One histogram family: per label set, a count per bucket and the sum (last item)."""

    __slots__ = ("bounds", "cells", "doc", "labels", "le", "name")

    def __init__(
        self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self.bounds = (*(float(b) for b in buckets), float("inf"))
        self.le = tuple(floatToGoString(b) for b in self.bounds)  # type: ignore[no-untyped-call]
        self.cells: dict[tuple[str, ...], list[float]] = {}

    def cell(self, *values: str) -> list[float]:
        """The cell of one label set (pass it to :meth:`observe`)."""
        c = self.cells.get(values)
        if c is None:
            c = self.cells[values] = [0.0] * (len(self.bounds) + 1)
        return c

    def observe(self, cell: list[float], value: float) -> None:
        """Count ``value`` in the first bucket whose bound it does not exceed."""
        cell[bisect_left(self.bounds, value)] += 1
        cell[-1] += value

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for values, c in list(self.cells.items()):
            counts, acc, buckets = c[:], 0.0, []
            for le, n in zip(self.le, counts, strict=False):
                acc += n
                buckets.append((le, acc))
            fam.add_metric(values, buckets, counts[-1])
        return fam


class CountsCollector(Collector):
    """Serves the families of ``counts``, in that order, to the registry's scrape."""

    def __init__(self, counts: Sequence[CounterCounts | HistogramCounts]) -> None:
        self.counts = tuple(counts)

    def describe(self) -> list[Metric]:
        """The families' names (the registry refuses a second metric of the same name)."""
        return [c.family() for c in self.counts]

    def collect(self) -> Iterator[Metric]:
        for c in self.counts:
            yield c.family()

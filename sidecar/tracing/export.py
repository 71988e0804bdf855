"""Spans off the request path: the SDK's batch processor, bounded, with every loss counted.

The request path only ends spans (:mod:`sidecar.tracing.spans`); the
OpenTelemetry SDK's :class:`~opentelemetry.sdk.trace.export.BatchSpanProcessor`
queues them and its own thread exports them in batches with the OTLP/HTTP exporter
(``requests``, protobuf). Two wrappers add what the SDK does not say:

* :class:`CountingProcessor` bounds the queue: a span that would find the queue full
  (``max_queue_size`` spans ended and not yet handed to the exporter) is dropped at
  once and counted; the SDK's own queue would drop its oldest span silently (a log
  line, no count). Memory held is at most the queue plus the one batch in export.
* :class:`CountingExporter` counts the spans of a batch whose export failed (the
  collector refused it, answered an error, or could not be reached within the
  exporter's retries and timeout) and logs ``trace_export_failed`` at most once a
  minute.

Both counts go to ``sidecar_trace_spans_dropped_total`` (contract, "Metrics"). A
collector that is down, slow or refusing costs the request path nothing: ending a
span is a deque append; the export thread is the one that waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from sidecar import logs

MAX_QUEUE_SIZE = 2048
"""Spans ended and waiting for export, at most (the SDK's default queue size;
``OTEL_BSP_MAX_QUEUE_SIZE``)."""
MAX_EXPORT_BATCH_SIZE = 512
"""Spans per export request (the SDK's default; ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``)."""
SCHEDULE_DELAY_MS = 5000
"""How long the export thread waits for a batch to fill before it sends what it has
(milliseconds; the SDK's default; ``OTEL_BSP_SCHEDULE_DELAY``)."""


class BatchSettings(NamedTuple):
    """The batch processor's sizes and delay (OpenTelemetry's ``OTEL_BSP_*`` variables)."""

    max_queue_size: int = MAX_QUEUE_SIZE
    max_export_batch_size: int = MAX_EXPORT_BATCH_SIZE
    schedule_delay_ms: int = SCHEDULE_DELAY_MS


def batch_settings(environ: Mapping[str, str]) -> BatchSettings:
    """The :class:`BatchSettings` from the standard ``OTEL_BSP_MAX_QUEUE_SIZE``,
    ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` and ``OTEL_BSP_SCHEDULE_DELAY`` variables (the
    OpenTelemetry SDK environment variable specification); an unset, malformed or
    non-positive one keeps its default; a batch is never larger than the queue."""

    def read(name: str, default: int) -> int:
        try:
            n = int(environ.get(name, ""))
        except ValueError:
            return default
        return n if n > 0 else default

    queue = read("OTEL_BSP_MAX_QUEUE_SIZE", MAX_QUEUE_SIZE)
    batch = min(queue, read("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", MAX_EXPORT_BATCH_SIZE))
    return BatchSettings(queue, batch, read("OTEL_BSP_SCHEDULE_DELAY", SCHEDULE_DELAY_MS))


FAILURE_LOG_INTERVAL_S = 60.0
"""``trace_export_failed`` is logged at most once per this many seconds."""


class _Pending:
    """Spans handed to the batch processor and not yet to the exporter (two threads)."""

    __slots__ = ("lock", "n")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0


class CountingExporter(SpanExporter):
    """Wraps the OTLP exporter: frees the queue's places of each batch it takes, and
    counts the spans of a failed export as dropped.

    :param inner: the exporter that sends (OTLP/HTTP).
    :param pending: the queue count shared with :class:`CountingProcessor`.
    :param dropped: called with a number of spans lost (the metric's ``inc``).
    """

    def __init__(
        self, inner: SpanExporter, pending: _Pending, dropped: Callable[[int], None]
    ) -> None:
        self.inner = inner
        self._pending = pending
        self._dropped = dropped
        self._logged_at = -FAILURE_LOG_INTERVAL_S

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Export one batch (the batch processor's thread). Never raises."""
        n = len(spans)
        with self._pending.lock:
            self._pending.n -= n
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not stop the export thread
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._dropped(n)
            now = time.monotonic()
            if now - self._logged_at >= FAILURE_LOG_INTERVAL_S:
                self._logged_at = now
                logs.event("trace_export_failed", level=logging.WARNING, spans=n)
        return result

    def shutdown(self) -> None:
        """Shut the exporter down: an export waiting between retries gives up."""
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class CountingProcessor(SpanProcessor):
    """A :class:`BatchSpanProcessor` whose queue never overflows: a span that finds it
    full is dropped here, and counted.

    :param exporter: the exporter to batch for (wrapped in :class:`CountingExporter`).
    :param dropped: called with a number of spans lost.
    :param settings: queue and batch sizes, and the delay (:func:`batch_settings`).
    """

    def __init__(
        self,
        exporter: SpanExporter,
        dropped: Callable[[int], None],
        settings: BatchSettings = BatchSettings(),  # noqa: B008  (an immutable tuple)
    ) -> None:
        self._pending = _Pending()
        self._max = settings.max_queue_size
        self._dropped = dropped
        self.exporter = CountingExporter(exporter, self._pending, dropped)
        self._batch = BatchSpanProcessor(
            self.exporter,
            max_queue_size=settings.max_queue_size,
            schedule_delay_millis=settings.schedule_delay_ms,
            max_export_batch_size=settings.max_export_batch_size,
        )
        self._closed = False

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing to do when a span starts."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue an ended span for export, or drop and count it (queue full, or shut down)."""
        ctx = span.context
        if ctx is None or not ctx.trace_flags.sampled:
            return  # never queued by the batch processor either
        pending = self._pending
        with pending.lock:
            if self._closed or pending.n >= self._max:
                full = True
            else:
                full = False
                pending.n += 1
        if full:
            self._dropped(1)
            return
        self._batch.on_end(span)

    def shutdown(self) -> None:
        """Export what is queued, then stop the export thread (blocks: see
        :meth:`sidecar.tracing.Tracing.shutdown`)."""
        with self._pending.lock:
            self._closed = True
        self._batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export everything queued now (blocks until the exporter returned)."""
        return self._batch.force_flush(timeout_millis)

"""The process's tracer (``[tracing]``; contract, "Traces"): imported only with that table.

Without ``[tracing]`` nothing of this package, nor of OpenTelemetry, is imported: the
proxy holds ``tracer = None`` and each request pays one ``is None`` test per hook
(:mod:`sidecar.proxy`). With it, :class:`Tracing` is the process's tracer:

- sampling is the SDK's ``ParentBased(TraceIdRatioBased(sample_ratio))``: a request's
  W3C ``traceparent`` (and ``tracestate``) makes its SERVER span a child of the app's
  span and the parent's sampled flag decides; without one, ``sample_ratio`` does. A
  request that is not sampled gets no span object at all (``ex.trace`` stays None): at
  ``sample_ratio = 0`` a request without ``traceparent`` costs one header lookup;
- spans go out through :mod:`sidecar.tracing.export` (batched, bounded, counted);
- :meth:`Tracing.shutdown` exports what is queued when the sidecar stops, within the
  stop's bound, and leaves no thread or socket behind.

The exporter is OpenTelemetry's OTLP/HTTP one (protobuf) at ``otlp_endpoint``; the
standard ``OTEL_EXPORTER_OTLP_TRACES_*`` / ``OTEL_EXPORTER_OTLP_*`` variables for
headers, timeout, compression and certificates apply (the endpoint is always the
config's). OpenTelemetry's own log records are silenced: the sidecar logs
``trace_export_failed`` itself and counts every lost span.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from aiohttp import web
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sidecar import __version__, logs, metrics
from sidecar.config import Config
from sidecar.tracing.attributes import operation_name
from sidecar.tracing.export import CountingProcessor, batch_settings
from sidecar.tracing.spans import TRACEPARENT, RequestTrace

_METHODS = frozenset(
    {"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"}
)
"""OpenTelemetry's HTTP conventions: any other method is recorded as ``_OTHER``."""

STOP_FLUSH_S = 1.0
"""At stop, the spans still queued get this long to reach the collector."""
ABORT_WAIT_S = 0.2
"""After that, how long the export thread gets to give up once its exporter is shut."""


_OTEL_LOGGER = logging.getLogger("opentelemetry")


def _quiet_opentelemetry() -> None:
    """OpenTelemetry's own log records (a warning per failed export, per dropped span)
    are not the sidecar's JSON lines: they are dropped (counted and logged by
    :mod:`sidecar.tracing.export` instead)."""
    _OTEL_LOGGER.propagate = False
    if not _OTEL_LOGGER.handlers:
        _OTEL_LOGGER.addHandler(logging.NullHandler())


class Tracing:
    """The process's tracer, built from ``config.tracing`` (which must be set).

    :param config: a validated config with a ``[tracing]`` table.
    :param environ: where the ``OTEL_BSP_*`` batch settings are read
        (:func:`~sidecar.tracing.export.batch_settings`; default :data:`os.environ`,
        where the exporter reads its ``OTEL_EXPORTER_OTLP_*`` variables too).
    :param exporter: the span exporter (default: OTLP/HTTP to ``otlp_endpoint``).
    """

    def __init__(
        self,
        config: Config,
        *,
        environ: Mapping[str, str] | None = None,
        exporter: SpanExporter | None = None,
    ) -> None:
        tc = config.tracing
        assert tc is not None
        _quiet_opentelemetry()
        self.propagate = tc.propagate
        self.never_root = tc.sample_ratio <= 0.0
        """No request without a sampled parent is traced: skip the SDK for those."""
        self.addresses = {
            name: urlsplit(up.base_url).hostname or "" for name, up in config.upstreams.items()
        }
        """``server.address`` by upstream name: the host of its ``base_url``."""
        metrics.register_tracing()
        self._registered = True
        self.provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(tc.sample_ratio)),
            resource=Resource.create({SERVICE_NAME: tc.service_name}),
            shutdown_on_exit=False,
        )
        self.processor = CountingProcessor(
            exporter or OTLPSpanExporter(endpoint=tc.otlp_endpoint),
            metrics.trace_spans_dropped,
            batch_settings(os.environ if environ is None else environ),
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("sidecar", __version__)
        url = urlsplit(tc.otlp_endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        logs.event(  # the collector's host and port only: never a path's or query's secret
            "tracing_started",
            collector=f"{url.hostname}:{port}",
            sample_ratio=tc.sample_ratio,
            propagate=tc.propagate,
            service_name=tc.service_name,
        )
        self._propagator = TraceContextTextMapPropagator()
        self._root = Context()

    def request(self, request: web.BaseRequest) -> RequestTrace | None:
        """The request arrived: its SERVER span (``http.request.method``, ``url.path``
        without the query), or None when it is not sampled.

        Its parent is the app's ``traceparent`` (W3C Trace Context; with its
        ``tracestate``) when valid; a malformed one is ignored (a new trace)."""
        headers = request.headers
        if TRACEPARENT in headers:
            parent = self._propagator.extract(headers, context=Context())
        elif self.never_root:
            return None
        else:
            parent = self._root
        method = request.method
        path = request.path
        span = self.tracer.start_span(
            method,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method if method in _METHODS else "_OTHER",
                "url.path": path,
            },
        )
        if not span.is_recording():
            return None
        return RequestTrace(
            self.tracer, span, method, operation_name(path), self.propagate, self.addresses
        )

    async def flush(self) -> None:
        """Export every span ended so far, now (the export runs in a thread of its own,
        awaited; for tests and tools that read the collector)."""
        await _in_thread(self.processor.force_flush, None)

    async def shutdown(self, budget_s: float) -> None:
        """Export what is queued and stop the export thread, within ``budget_s`` seconds
        (the stop's: the flush gets at most :data:`STOP_FLUSH_S` of it): past that, the
        exporter is shut down (an export waiting between retries gives up, its spans
        counted as dropped) and the thread is left to end by itself. Call once; the
        metric leaves ``/metrics`` with the last tracer."""
        if self._registered:
            self._registered = False
            metrics.unregister_tracing()
        flush_s = max(0.0, min(STOP_FLUSH_S, budget_s - 2 * ABORT_WAIT_S))
        if await _in_thread(self.provider.shutdown, flush_s):
            return
        self.processor.exporter.shutdown()
        await _in_thread(lambda: None, ABORT_WAIT_S)


async def _in_thread(fn: Callable[[], object], timeout_s: float | None) -> bool:
    """Run ``fn`` in a thread of its own (no executor thread is left behind) and await
    it up to ``timeout_s`` seconds (None: until it returns). True when it returned."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def run() -> None:
        try:
            fn()
        finally:
            loop.call_soon_threadsafe(_resolve, done)

    thread = threading.Thread(target=run, name="sidecar-tracing", daemon=True)
    thread.start()
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except TimeoutError:
        return False
    thread.join()
    return True


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)

"""A real OTLP/HTTP trace receiver on loopback, for the tracing tests.

An aiohttp server on ``127.0.0.1`` port 0 that accepts ``POST /v1/traces`` (protobuf),
decodes each body as an ``ExportTraceServiceRequest`` with OpenTelemetry's own
definitions (``opentelemetry-proto``), keeps every span, and answers as told: 200 with
an ``ExportTraceServiceResponse`` (default), another status (``status=500``), or only
once ``gate`` is set (a collector that is slow: never answers during the test).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

SERVER = Span.SpanKind.SPAN_KIND_SERVER
CLIENT = Span.SpanKind.SPAN_KIND_CLIENT


def value(v: AnyValue) -> Any:
    """A protobuf ``AnyValue`` as a Python value (arrays as lists)."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attrs(v.kvlist_value.values)
    return None if kind is None else getattr(v, kind)


def attrs(kvs: Any) -> dict[str, Any]:
    """Repeated ``KeyValue`` as a dict."""
    return {kv.key: value(kv.value) for kv in kvs}


def strings(kvs: Any) -> Iterator[str]:
    """Every key and every value (as text) of repeated ``KeyValue``, nested included."""
    kv: KeyValue
    for kv in kvs:
        yield kv.key
        yield str(value(kv.value))


@dataclass
class OtlpCollector:
    """``async with OtlpCollector() as c:``; point ``otlp_endpoint`` at :attr:`endpoint`."""

    status: int = 200
    gate: asyncio.Event | None = None
    posts: int = 0
    """Export requests received (answered or not)."""
    spans: list[Span] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    _port: int = 0
    _received: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._port}/v1/traces"

    async def __aenter__(self) -> OtlpCollector:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.gate is not None:
            self.gate.set()
        assert self._runner is not None
        await self._runner.cleanup()

    async def wait_for_post(self) -> None:
        """Until an export request has arrived (since the last call)."""
        await self._received.wait()
        self._received.clear()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.posts += 1
        self.bodies.append(body)
        self._received.set()
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            self.resources.append(attrs(rs.resource.attributes))
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        if self.gate is not None:
            await self.gate.wait()
        return web.Response(
            status=self.status,
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def of_kind(self, kind: int) -> list[Span]:
        return [s for s in self.spans if s.kind == kind]

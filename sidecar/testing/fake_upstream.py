"""`FakeUpstream`: a real aiohttp server that speaks OpenAI/Anthropic and misbehaves on command."""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from ._server import CountingProtocol, CountingSite, send_response
from .fault import Fault, ReceivedRequest, fault_from_json
from .net import LOOPBACK
from .render import bad_fault_body, json_object, render

__all__ = ["DEFAULT_MODELS", "FAULT_FOR_HEADER", "FAULT_HEADER", "FakeUpstream", "ReceivedRequest"]

FAULT_HEADER = "x-fake-fault"
"""Request header carrying a JSON :class:`Fault` override, e.g. ``{"status": 503}``."""
FAULT_FOR_HEADER = "x-fake-fault-for"
"""Request header aiming :data:`FAULT_HEADER` at some fakes only: comma-separated fake
names (``primary`` or ``primary, key_b``); a fake whose ``name`` is not listed (or that
has none) ignores the fault header. Without it, the fault header applies on every fake."""
RATE_LIMITED = Fault(status=429)
"""The default of :meth:`FakeUpstream.fault_for_key`: a key over its rate limit."""
DEFAULT_MODELS = ("gpt-4o", "gpt-4o-mini", "text-embedding-3-small", "claude-sonnet-4-5")


class FakeUpstream:
    """A fault-injecting fake LLM provider on ``127.0.0.1``: a real aiohttp server.

    Use ``async with FakeUpstream() as fake:`` and point clients at ``fake.url``.
    Routes (matched on the path's end, so a base-URL prefix works; ``/echo/...``
    always echoes): ``POST .../chat/completions`` (JSON, or SSE when the body has
    ``"stream": true``), ``POST .../embeddings``, ``POST .../responses``,
    ``POST .../messages`` (Anthropic; SSE when streaming), ``GET .../models``
    (Anthropic's page shape when the request has ``anthropic-version``), and
    anything else: a JSON echo ``{method, path, query_string, headers: [[k, v]...],
    body, body_base64}``. Generated bodies echo the request's ``model``.

    Each request's :class:`Fault` is, in order of precedence: the
    ``x-fake-fault`` header (JSON fields over ``default``; consumes no script),
    the fault of the request's API key (:meth:`fault_for_key`: a provider that
    rate-limits one key), the next entry of the request model's script (:meth:`script_for_model`),
    the next entry of the global script (:meth:`script`), else ``default``.

    A proxy in front relays the request's headers to every upstream it tries, so the
    ``x-fake-fault`` header alone would reach each fallback too. To make one fake fail
    and show the fallback, start the fakes with names and add ``x-fake-fault-for:
    NAME[, NAME...]`` (:data:`FAULT_FOR_HEADER`): a fake whose ``name`` is not listed
    ignores the fault header and answers as if it were absent (script, then default).

    Accounting: ``requests`` (list of :class:`ReceivedRequest`),
    ``request_count``, ``connections_accepted`` (TCP accepts counted at the
    protocol factory, so keep-alive reuse is visible), ``open_connections``,
    ``active_requests`` (handlers running). Wait on them without sleeping with
    :meth:`wait_until` / :meth:`wait_for_requests`. ``app`` is the
    :class:`aiohttp.web.Application`; served elsewhere it works but the
    connection counters stay 0.
    """

    def __init__(
        self,
        *,
        port: int = 0,
        default: Fault | None = None,
        models: Iterable[str] = DEFAULT_MODELS,
        record_requests: bool = True,
        on_request: Callable[[ReceivedRequest], None] | None = None,
        name: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``port`` 0 picks a free one; ``record_requests=False`` keeps ``requests``
        empty (long benchmarks) while ``request_count`` still counts. ``on_request``
        is called with each request as it is recorded, before the answer (the
        command line logs a line with it). ``name`` is what ``x-fake-fault-for``
        matches (exactly, case-sensitive); None: no name, so a fault aimed with that
        header never applies here. ``tls``: a server-side context; the fake then
        speaks HTTPS (:attr:`url` is ``https://``)."""
        self.name = name
        self._tls = tls
        self.on_request = on_request
        self.default: Fault = default or Fault()
        self.models: list[str] = list(models)
        self.record_requests = record_requests
        self.requests: list[ReceivedRequest] = []
        self.request_count = 0
        self.connections_accepted = 0
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self._handle)
        self._wanted_port = port
        self._port: int | None = None
        self._runner: web.AppRunner | None = None
        self._script: deque[Fault] = deque()
        self._model_scripts: dict[str, deque[Fault]] = {}
        self._key_faults: dict[str, Fault] = {}
        self._transports: dict[asyncio.Transport, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiters: list[tuple[asyncio.Future[None], Callable[[], bool]]] = []
        self._release = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> FakeUpstream:
        """Listen on 127.0.0.1 (once per instance); returns ``self``."""
        if self._runner is not None or self.app.frozen:
            raise RuntimeError("FakeUpstream can be started only once")
        runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0
        )
        await runner.setup()
        server = runner.server
        assert server is not None
        site = CountingSite(
            runner,
            self._wanted_port,
            lambda: CountingProtocol(server(), self._connection_made, self._connection_lost),
            self._tls,
        )
        await site.start()
        self._runner, self._port = runner, site.bound_port
        return self

    async def close(self) -> None:
        """Stop listening, end every in-flight response (stalled ones included: their
        connections are closed mid-response) and close all connections. Idempotent."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for site in list(runner.sites):
            await site.stop()
        for task in list(self._tasks):
            task.cancel()
        await runner.cleanup()
        for transport in list(self._transports):
            transport.abort()
        await self.wait_until(lambda: not self._transports and not self._tasks)

    async def __aenter__(self) -> FakeUpstream:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def port(self) -> int:
        """The listening port (after ``start()``)."""
        if self._port is None:
            raise RuntimeError("FakeUpstream is not started")
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (``https://`` with ``tls``), no trailing slash."""
        scheme = "http" if self._tls is None else "https"
        return f"{scheme}://{LOOPBACK}:{self.port}"

    # -- behaviour -------------------------------------------------------------

    def script(self, faults: Iterable[Fault]) -> None:
        """Replace the global script: a FIFO, one fault per request, then ``default``."""
        self._script = deque(faults)

    def script_for_model(self, model: str, faults: Iterable[Fault]) -> None:
        """Replace the script for requests whose body ``model`` equals ``model``;
        when it is empty such requests fall through to the global script."""
        self._model_scripts[model] = deque(faults)

    def fault_for_key(self, key: str, fault: Fault | None = RATE_LIMITED) -> None:
        """Answer every request carrying API key ``key`` (``Authorization: Bearer key`` or
        ``x-api-key: key``) with ``fault``, as a provider does with a key over its rate
        limit (a 429 by default) while other keys are served; None: stop."""
        if fault is None:
            self._key_faults.pop(key, None)
        else:
            self._key_faults[key] = fault

    def _key_fault(self, headers: Mapping[str, str]) -> Fault | None:
        auth = headers.get("authorization", "")
        key = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key")
        return None if key is None else self._key_faults.get(key)

    def set_default(self, fault: Fault) -> None:
        """Set the fault used when no script applies (same as assigning ``default``)."""
        self.default = fault

    def release(self) -> None:
        """Let every currently stalled response (``stall``, ``stall_after_chunks``) go on."""
        self._release.set()
        self._release = asyncio.Event()

    async def _wait_released(self) -> None:
        await self._release.wait()

    # -- accounting ------------------------------------------------------------

    @property
    def open_connections(self) -> int:
        """TCP connections currently open (accepted and not yet lost)."""
        return len(self._transports)

    @property
    def active_requests(self) -> int:
        """Request handlers still running (0 once every response ended or was reset)."""
        return len(self._tasks)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` is true, re-checking it on every change of the
        fake's state (request arrival, handler end, connection accepted or lost).
        No timeout: wrap it in :func:`asyncio.timeout` when needed."""
        if predicate():
            return
        entry = (asyncio.get_running_loop().create_future(), predicate)
        self._waiters.append(entry)
        try:
            await entry[0]
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    async def wait_for_requests(self, n: int) -> None:
        """Return once ``request_count >= n`` (the n-th request was read and recorded)."""
        await self.wait_until(lambda: self.request_count >= n)

    async def wait_for_connections(self, n: int) -> None:
        """Return once ``connections_accepted >= n``."""
        await self.wait_until(lambda: self.connections_accepted >= n)

    def _changed(self) -> None:
        for fut, predicate in self._waiters:
            if not fut.done() and predicate():
                fut.set_result(None)

    def _connection_made(self, transport: asyncio.Transport) -> None:
        self.connections_accepted += 1
        self._transports[transport] = self.connections_accepted
        self._changed()

    def _connection_lost(self, transport: asyncio.Transport) -> None:
        if self._transports.pop(transport, None) is not None:
            self._changed()

    # -- serving ---------------------------------------------------------------

    def fault_header_applies(self, headers: Mapping[str, str]) -> bool:
        """True when a request with ``headers`` gets its fault from ``x-fake-fault``:
        the header is present and either no ``x-fake-fault-for`` is, or it lists this
        fake's ``name``."""
        if FAULT_HEADER not in headers:
            return False
        aimed = headers.get(FAULT_FOR_HEADER)
        if aimed is None:
            return True
        return self.name is not None and self.name in {n.strip() for n in aimed.split(",")}

    def _pick(self, model: str | None, header: str | None) -> Fault:
        if header is not None:
            return fault_from_json(header, self.default)
        if model is not None and (queue := self._model_scripts.get(model)):
            return queue.popleft()
        if self._script:
            return self._script.popleft()
        return self.default

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await self._serve(request)
        finally:
            self._tasks.discard(task)
            self._changed()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        doc = json_object(body)
        model = doc.get("model") if isinstance(doc.get("model"), str) else None
        error = None
        try:
            header = (
                request.headers[FAULT_HEADER]
                if self.fault_header_applies(request.headers)
                else None
            )
            keyed = self._key_fault(request.headers) if self._key_faults else None
            fault = keyed if header is None and keyed is not None else self._pick(model, header)
        except ValueError as exc:
            fault, error = Fault(status=400), f"bad {FAULT_HEADER} header: {exc}"
        self.request_count += 1
        rec = ReceivedRequest(
            index=self.request_count,
            method=request.method,
            path=request.path,
            query_string=request.query_string,
            headers=CIMultiDict(request.headers),
            body=body,
            model=model,
            stream=doc.get("stream") is True,
            fault=fault,
            connection=self._transports.get(request.transport, 0) if request.transport else 0,
        )
        if self.record_requests:
            self.requests.append(rec)
        if self.on_request is not None:
            self.on_request(rec)
        self._changed()
        body_out = bad_fault_body(error) if error else render(rec, doc, self.models)
        return await send_response(request, rec, body_out, self._wait_released)

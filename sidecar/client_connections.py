"""A deadline for the request head on the proxy port (``server.client_read_timeout_ms``).

aiohttp's server bounds the request *body* read only where the handler asks
(:func:`sidecar.proxy._read_body` does), and has no timeout at all for the
request *head* (request line and headers): a client that opens a connection
and sends its headers one byte at a time, or nothing, holds a connection and a
task for as long as it likes (slowloris).

:class:`HeadDeadlines` closes that gap with no parsing of its own. Every proxy
connection's protocol is aiohttp's ``RequestHandler`` wrapped in
:class:`_GuardedConnection` (the wrapping that :mod:`sidecar.testing._server`
uses to count connections), and the proxy app has the middleware
:attr:`HeadDeadlines.middleware`, which tells the connection when aiohttp has
handed it a complete request head and when that request's handler has ended.
The rule:

* A connection with no request in its handler must deliver a complete request
  head within ``client_read_timeout_ms`` of being accepted, or of its previous
  request's handler ending (so an idle keep-alive connection is also closed
  after that long; clients reconnect as they do after any idle close).
* When the deadline passes, the connection is closed. If it has not served a
  request yet and some bytes of a head arrived, it first gets
  ``408 Request Timeout`` with ``Connection: close`` (a protocol-level answer
  like the HTTP parser's own 400, not a JSON error: the path, which picks the
  error shape, may not have arrived). On a keep-alive connection it is closed
  silently, as an idle connection would be: an unsolicited answer there could
  be taken for the answer to the client's next request.

Cost: one timer per connection, re-armed lazily (a request only stores its end
time; a timer that fires early reschedules itself), one dict entry per open
connection, one coroutine frame per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web
from aiohttp.typedefs import Middleware
from yarl import URL

__all__ = ["TIMEOUT_RESPONSE", "HeadDeadlines"]

TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
"""What a connection whose first request head was too slow gets before it is closed."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HeadDeadlines:
    """The proxy port's open client connections and their request-head deadlines.

    :param timeout_s: returns the deadline in seconds (``client_read_timeout_ms /
        1000`` of the current config); read each time a deadline is set, so a
        config reload applies from the next one.
    """

    def __init__(self, timeout_s: Callable[[], float]) -> None:
        self.timeout_s = timeout_s
        self._open: dict[asyncio.Transport, _GuardedConnection] = {}
        self.cut_off = 0
        """Connections closed so far because their request head did not arrive in time."""

    @property
    def open_connections(self) -> int:
        """Client connections currently open on the proxy port."""
        return len(self._open)

    def protocol_factory(
        self, inner: Callable[[], asyncio.Protocol]
    ) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` wrapping ``inner``'s protocols.

        :param inner: aiohttp's protocol factory (``runner.server``).
        """
        return lambda: _GuardedConnection(inner(), self)

    def abort_all(self) -> int:
        """Abort every open client connection (end of a drain); return how many there were.

        aiohttp then cancels their handlers (``handler_cancellation``); their
        clients see the connection reset, never a clean end of a response.
        """
        transports = list(self._open)
        for transport in transports:
            transport.abort()
        return len(transports)

    @property
    def middleware(self) -> Middleware:
        """An aiohttp middleware reporting each request's start and end to its connection.

        A middleware rather than a wrapped route handler so that the router's own
        answers (404 for ``OPTIONS *``, ``CONNECT``) count as served requests too.
        """
        connections = self._open

        @web.middleware
        async def head_deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
            conn = connections.get(request.transport) if request.transport is not None else None
            if conn is None:  # connection already lost, or not served through our site
                return await handler(request)
            conn.busy += 1
            try:
                return await handler(request)
            finally:
                conn.request_ended()

        return head_deadline

    def site(self, runner: web.BaseRunner, host: str | None, port: int) -> web.BaseSite:
        """A TCP site on ``host:port`` serving ``runner`` through guarded connections.

        Registered with the runner like :class:`aiohttp.web.TCPSite`, so
        ``runner.cleanup()`` stops it and ``runner.addresses`` lists it.
        """
        return _GuardedSite(runner, host, port, self)

    def _made(self, transport: asyncio.Transport, conn: _GuardedConnection) -> None:
        self._open[transport] = conn

    def _lost(self, transport: asyncio.Transport) -> None:
        self._open.pop(transport, None)


class _GuardedConnection(asyncio.Protocol):
    """aiohttp's ``RequestHandler`` for one connection, plus its head deadline.

    Everything is delegated to ``inner``; this only arms the deadline and closes
    the transport when it passes with no request in a handler.
    """

    __slots__ = ("_timer", "busy", "deadline", "got_bytes", "guard", "inner", "served", "transport")

    def __init__(self, inner: asyncio.Protocol, guard: HeadDeadlines) -> None:
        self.inner = inner
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.busy = 0
        """Requests of this connection currently in the proxy handler."""
        self.served = 0
        """Requests of this connection whose handler has ended."""
        self.got_bytes = False
        self.deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- the deadline -------------------------------------------------------------

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + self.guard.timeout_s()
        if self._timer is None:
            self._timer = loop.call_at(self.deadline, self._check)

    def _check(self) -> None:
        self._timer = None
        transport = self.transport
        if self.busy or transport is None or transport.is_closing():
            return  # request_ended() re-arms
        loop = asyncio.get_running_loop()
        if loop.time() < self.deadline:  # a request ended since: not due yet
            self._timer = loop.call_at(self.deadline, self._check)
            return
        self.guard.cut_off += 1
        if not self.served and self.got_bytes and not transport.get_write_buffer_size():
            transport.write(TIMEOUT_RESPONSE)
        transport.close()

    def request_ended(self) -> None:
        """The handler of one request of this connection ended: the next head's clock starts."""
        self.busy -= 1
        self.served += 1
        if not self.busy and self.transport is not None:
            self._arm()

    # -- asyncio.Protocol, delegated ----------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.guard._made(self.transport, self)
        self._arm()
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.guard._lost(self.transport)
            self.transport = None
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _GuardedSite(web.BaseSite):
    """Like :class:`aiohttp.web.TCPSite`, with :class:`_GuardedConnection` protocols."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(
        self, runner: web.BaseRunner, host: str | None, port: int, guard: HeadDeadlines
    ) -> None:
        super().__init__(runner)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self._host or "0.0.0.0", port=self._port))

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._guard.protocol_factory(server), self._host, self._port, backlog=self._backlog
        )

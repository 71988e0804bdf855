"""The proxy port's client connections: aiohttp's low-level server, plus a request-head deadline.

:class:`ProxyServer` is :class:`aiohttp.web.Server` (no ``Application``, router or
middleware: every request goes to :meth:`sidecar.proxy.Proxy.handle`) whose
connections are :class:`DownstreamConnection`, aiohttp's own ``RequestHandler`` with
one addition. aiohttp bounds the request *body* read only where the handler asks
(the proxy does), and the request *head* (request line and headers) not at all:
a client that sends its headers one byte at a time, or nothing, would hold a
connection for as long as it likes (slowloris). The rule
(``server.client_read_timeout_ms``, read from the injected clock):

* A connection with no request in the handler must deliver a complete request head
  within ``client_read_timeout_ms`` of being accepted, or of its previous request's
  handler ending (so an idle keep-alive connection is also closed after that long;
  clients reconnect as they do after any idle close).
* When the deadline passes, the connection is closed. If it has not served a request
  yet and some bytes of a head arrived, it first gets ``408 Request Timeout`` with
  ``Connection: close`` (a protocol-level answer like the HTTP parser's own 400, not a
  JSON error: the path, which picks the error shape, may not have arrived). On a
  keep-alive connection it is closed silently, as an idle connection would be: an
  unsolicited answer there could be taken for the answer to the client's next request.

Cost: one timer per connection, re-armed lazily (a request only stores its end
time; a timer that fires early re-arms itself). No parsing of its own.

A head over the parser's limits (a request line or a field line over 8190 bytes, more
than 128 fields) is answered ``431 Request Header Fields Too Large`` (contract, the table
of error answers; RFC 6585 section 5) where aiohttp answers 400
(:meth:`DownstreamConnection.handle_error`): the parser's ``LineTooLong`` and its
"Too many headers received" are what mark it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from itertools import chain
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from sidecar.clock import Clock, TimerHandle

__all__ = [
    "TIMEOUT_RESPONSE",
    "TOO_MANY_HEADERS",
    "DownstreamConnection",
    "ProxyServer",
    "send_continue",
    "wide_head",
]

TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
"""What a connection whose first request head was too slow gets before it is closed."""

TOO_MANY_HEADERS = "Too many headers received"
"""The message of aiohttp's ``BadHttpMessage`` for a head of more than ``max_headers``
fields (both its parsers; ``tests/unit/test_downstream.py`` pins it)."""


def head_too_large(exc: BaseException | None) -> bool:
    """Whether the parser refused a request because its head is over its limits: a line
    over ``max_line_size`` / ``max_field_size`` (``LineTooLong``) or more than
    ``max_headers`` fields."""
    return isinstance(exc, LineTooLong) or (
        isinstance(exc, BadHttpMessage) and exc.message == TOO_MANY_HEADERS
    )


class ProxyServer(web.Server):
    """aiohttp's low-level server for the proxy port, with :class:`DownstreamConnection` protocols.

    :param handler: the request handler (``Proxy.handle``).
    :param clock: the injected clock for the request-head deadlines.
    :param timeout_s: returns ``client_read_timeout_ms / 1000`` of the current config;
        read each time a deadline is set, so a config reload applies from the next one.
    :param handler_kwargs: passed to each ``RequestHandler`` (``auto_decompress``, ...).
    """

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Any],
        *,
        clock: Clock,
        timeout_s: Callable[[], float],
        handler_cancellation: bool = True,
        **handler_kwargs: Any,
    ) -> None:
        super().__init__(handler, handler_cancellation=handler_cancellation, **handler_kwargs)
        self.clock = clock
        self.timeout_s = timeout_s
        self._handler_kwargs = handler_kwargs
        self.open: dict[asyncio.Transport, DownstreamConnection] = {}
        """Client connections currently open, by transport."""

    @property
    def open_connections(self) -> int:
        """Client connections currently open on the proxy port."""
        return len(self.open)

    def abort_all(self) -> int:
        """Abort every open client connection (end of a drain); return how many there were.

        aiohttp then cancels their handlers (``handler_cancellation``); their
        clients see the connection reset, never a clean end of a response.
        """
        transports = list(self.open)
        for transport in transports:
            transport.abort()
        return len(transports)

    def __call__(self) -> DownstreamConnection:
        return DownstreamConnection(self, loop=asyncio.get_running_loop(), **self._handler_kwargs)


class DownstreamConnection(RequestHandler):
    """aiohttp's ``RequestHandler`` for one client connection, plus its head deadline.

    The proxy handler raises :attr:`busy` when a request's head has arrived and
    calls :meth:`request_ended` when its handler ends.
    """

    __slots__ = ("_deadline_timer", "busy", "deadline", "got_bytes", "served", "server", "wide")

    def __init__(self, server: ProxyServer, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self.server = server
        self.busy = 0
        """Requests of this connection currently in the proxy handler."""
        self.served = 0
        """Requests of this connection whose handler has ended."""
        self.got_bytes = False
        self.wide = False
        """Some byte this connection received is outside ASCII (a head's obs-text, or
        a body's UTF-8): its requests' heads are looked at for it (rare; see
        :func:`wide_head`)."""
        self.deadline = 0.0
        self._deadline_timer: TimerHandle | None = None

    def _arm(self) -> None:
        server = self.server
        self.deadline = server.clock.now() + server.timeout_s()
        if self._deadline_timer is None:
            self._deadline_timer = server.clock.call_at(self.deadline, self._check)

    def _check(self) -> None:
        self._deadline_timer = None
        transport = self.transport
        if self.busy or transport is None or transport.is_closing():
            return  # request_ended() re-arms
        clock = self.server.clock
        if clock.now() < self.deadline:  # a request ended since: not due yet
            self._deadline_timer = clock.call_at(self.deadline, self._check)
            return
        if not self.served and self.got_bytes and not transport.get_write_buffer_size():
            transport.write(TIMEOUT_RESPONSE)
        transport.close()

    def request_ended(self) -> None:
        """The handler of one request of this connection ended: the next head's clock starts."""
        self.busy -= 1
        self.served += 1
        if not self.busy and self.transport is not None:
            self._arm()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.open[cast(asyncio.Transport, transport)] = self
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        transport = self.transport
        if transport is not None:
            self.server.open.pop(transport, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if not data.isascii():
            self.wide = True
        super().data_received(data)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request its parser refused (and to a handler's crash),
        with ``431`` where the head is over the parser's limits (contract, the table of
        error answers; RFC 6585 section 5) rather than aiohttp's 400. The connection is
        closed after it, as after any parser error. Only ever called on that rare path."""
        if status == 400 and head_too_large(exc):
            status = 431
            if isinstance(exc, HttpProcessingError):
                exc.code = 431  # the bad_client_request warning logs the status sent
        return super().handle_error(request, status, exc, message)


def wide_head(request: web.BaseRequest) -> bool:
    """Whether ``request``'s header fields hold an octet outside ASCII (obs-text or UTF-8,
    RFC 9110 section 5.5), read from the bytes the parser kept. Only for a request of a
    :attr:`DownstreamConnection.wide` connection."""
    return not b"".join(chain.from_iterable(request.raw_headers)).isascii()


async def send_continue(request: web.BaseRequest) -> None:
    """Write the interim ``100 Continue`` (RFC 9110 section 15.2.1) to ``request``'s
    client, as aiohttp's router does for ``Expect: 100-continue``: the bytes go out on
    the request's writer, whose count of bytes sent is then set back to 0 (the final
    answer's size is its own)."""
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0

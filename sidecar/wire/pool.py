"""The upstream connection pool: aiohttp's TCP connector, telling each request about its connection.

Two contract rules need to know what the pool did for one request, and aiohttp
says it only through its tracing signals (a ``TraceConfig`` costs every request
its ``Trace`` objects and signal sends, ~16 us of ~290 in the profile):

* "A request that fails on a reused keep-alive connection before any response byte
  ... is resent once on a new connection": was the connection taken from the pool?
* "Waiting for a pooled connection is not charged to the first-byte timeout", and a
  request cancelled while waiting was never sent, so it is not an attempt: is the
  request waiting for a free connection (``max_connections`` busy)?

:class:`PoolConnector` answers both by overriding two of
:class:`aiohttp.TCPConnector`'s internal steps, ``_get`` (a connection taken from
the pool) and ``_wait_for_available_connection`` (the wait for a free slot). A third,
``_release`` (a connection put back in the pool), marks it idle, so that
:class:`UpstreamProtocol` closes a pooled connection that receives any byte while idle
("A pooled upstream connection that received any byte while idle ... is never reused").
They are private to aiohttp: ``tests/unit/test_pool.py`` fails loudly when an
aiohttp release changes them. The request being served is handed down explicitly:
:func:`~sidecar.wire.upstream_call.call` passes its :class:`PoolWatcher` in the
``traces`` list it gives ``connect`` (:class:`Watched`, an empty list aiohttp sends no
signal to), and the overridden steps read it there.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.helpers import _EXC_SENTINEL, TimerNoop
from aiohttp.http_exceptions import HttpProcessingError

if TYPE_CHECKING:
    from aiohttp.connector import Connection
    from aiohttp.tracing import Trace


class PoolWatcher(Protocol):
    """What the connector tells a request (:class:`sidecar.exchange.Exchange`)."""

    reused: bool

    def wait_for_connection(self, waiting: bool) -> None: ...


class Pump(Protocol):
    """What a connection's protocol calls as bytes arrive
    (:class:`~sidecar.wire.push_pump.PushPump`)."""

    def pump(self) -> None: ...


class Watched(list["Trace"]):
    """The ``traces`` argument :func:`~sidecar.wire.upstream_call.call` hands to
    ``TCPConnector.connect``, carrying the request's :class:`PoolWatcher` down to the
    connector's steps (``_get``, ``_wait_for_available_connection``), which aiohttp
    passes the same list. It holds no trace, so aiohttp sends no tracing signal."""

    __slots__ = ("watcher",)

    def __init__(self, watcher: PoolWatcher) -> None:
        super().__init__()
        self.watcher = watcher


def _watcher(traces: object) -> PoolWatcher | None:
    return traces.watcher if type(traces) is Watched else None


class UpstreamProtocol(ResponseHandler):
    """aiohttp's client protocol, noting whether any byte arrived since :attr:`received`
    was last cleared (:func:`sidecar.wire.upstream_call.call` clears it as a request starts),
    and taking a connection lost with an error before the body's end as a cut of the
    body (aiohttp's private ``_payload``: the response's reader).

    The resend-once rule covers only a request that failed "before any response byte"
    (contract): aiohttp reports an upstream that closed after part of a head the same
    way as one that closed before any byte (``ServerDisconnectedError``).
    """

    received = False
    push: Pump | None = None
    """The pump of a committed chunked stream on this connection (:mod:`sidecar.wire.push_pump`)."""
    pooled = False
    """Idle in the pool (:meth:`PoolConnector._release` put it there, ``_get`` has not
    taken it out): no request expects a byte from it."""

    session: aiohttp.ClientSession | None = None
    """The session of the request being served (set by
    :func:`~sidecar.wire.upstream_call.call`): its parser limits, for :meth:`set_exception`."""
    head_chunk: bytes | None = None
    """While the first chunk of a response is being parsed: that chunk."""

    def set_exception(self, exc: BaseException, exc_cause: BaseException = _EXC_SENTINEL) -> None:
        """aiohttp's, except where the parser failed on bytes *after* a complete answer
        that began the chunk (a 204 with a body, more bytes than ``Content-Length``):
        aiohttp's parser raises for the whole chunk and the complete answer is lost (a
        broken response, retried and counted by the breaker). RFC 9112 section 6.3: the
        answer ends where its framing says, and the data after it is discarded, never
        taken as a response; here the complete answer is parsed again alone and
        delivered, and the connection, already closing, is not reused (nginx and Envoy
        do the same). Only called on a failure."""
        chunk = self.head_chunk
        if chunk is not None and isinstance(exc_cause, HttpProcessingError):
            self.head_chunk = None
            end = complete_answer_end(chunk, self._skip_payload)
            if end is not None and end < len(chunk) and self.session is not None:
                self._should_close = True
                session = self.session
                connector = session.connector
                assert connector is not None
                self.set_response_params(  # a new parser
                    timer=_NO_TIMER,
                    skip_payload=self._skip_payload,
                    read_until_eof=True,
                    auto_decompress=False,
                    read_timeout=None,
                    read_bufsize=self._read_bufsize,
                    timeout_ceil_threshold=connector._timeout_ceil_threshold,
                    max_line_size=session._max_line_size,
                    max_field_size=session._max_field_size,
                    max_headers=session._max_headers,
                )
                _handler_data_received(self, chunk[:end])  # a failure here is aiohttp's
                return
        super().set_exception(exc, exc_cause)

    def data_received(self, data: bytes) -> None:
        if self.pooled and data:  # (aiohttp feeds b"" itself when it resumes reading)
            # Contract, "The proxy port": a pooled connection that received any byte
            # while idle (an unsolicited answer such as a 408 sent before the server
            # closes it) is never reused: closed now, so no request takes those bytes
            # as its answer (the pool's next ``_get`` finds it closed and drops it).
            self.pooled = False
            transport = self.transport
            if transport is not None:
                transport.close()
            return
        if self.received:
            _handler_data_received(self, data)  # no super() object per chunk
        else:  # the first chunk of a response: set_exception may need it
            self.received = True
            self.head_chunk = data
            _handler_data_received(self, data)
            self.head_chunk = None
        if self.push is not None:
            self.push.pump()

    def connection_lost(self, exc: BaseException | None) -> None:
        payload = self._payload
        if exc is not None and payload is not None and not payload.is_eof():
            # A reset (or any error) before the body's end is a cut (contract, "The proxy
            # port"): aiohttp's parser takes the end of the connection as the end of a
            # body with neither Content-Length nor chunked framing, whatever ended it.
            payload.set_exception(
                aiohttp.ClientPayloadError(f"Response payload is not completed: {exc!r}"), exc
            )
        super().connection_lost(exc)
        if self.push is not None:  # the reader now holds the end or the failure
            self.push.pump()


_handler_data_received = ResponseHandler.data_received

_NO_TIMER = TimerNoop()

_CONTENT_LENGTH = re.compile(
    rb"\r\ncontent-length[ \t]*:[ \t]*([0-9]+)[ \t]*(?=\r\n)", re.IGNORECASE
)
_TRANSFER_ENCODING = re.compile(rb"\r\ntransfer-encoding[ \t]*:", re.IGNORECASE)


def complete_answer_end(data: bytes, bodiless: bool) -> int | None:
    """Where the answer that begins ``data`` ends, when all of it is in ``data``: its head,
    then no body (``bodiless``: a HEAD request's; a 204 or 304, RFC 9110 sections 15.3.5,
    15.4.5) or exactly one ``Content-Length`` of bytes (RFC 9112 section 6.3). None for
    any other answer (a 1xx, chunked or close-delimited framing, an incomplete one)."""
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0 or not data.startswith(b"HTTP/1."):
        return None
    head = data[: head_end + 2]
    status = data[9:12]
    if status[:1] == b"1" or _TRANSFER_ENCODING.search(head):
        return None
    end = head_end + 4
    if bodiless or status in (b"204", b"304"):
        return end
    lengths = _CONTENT_LENGTH.findall(head)
    if len(lengths) != 1:
        return None
    end += int(lengths[0])
    return end if end <= len(data) else None


_connector_release = aiohttp.TCPConnector._release


class PoolConnector(aiohttp.TCPConnector):
    """:class:`aiohttp.TCPConnector` that reports reuse and waits to the request's watcher."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(UpstreamProtocol, loop=self._loop)  # type: ignore[assignment]
        self.waiting = 0
        """Requests waiting for a free connection now (``max_connections`` busy)."""

    @property
    def full(self) -> bool:
        """Whether every one of the ``limit`` (``max_connections``) connections is in use
        (False without a limit): a new request would wait for one."""
        limit = self.limit
        return limit > 0 and len(self._acquired) >= limit

    async def _get(self, key: Any, traces: list[Trace]) -> Connection | None:
        conn = await super()._get(key, traces)
        if conn is not None:
            proto = conn.protocol
            if isinstance(proto, UpstreamProtocol):
                proto.pooled = False
            watcher = _watcher(traces)
            if watcher is not None:
                watcher.reused = True
        return conn

    def _release(self, key: Any, protocol: ResponseHandler, *, should_close: bool = False) -> None:
        _connector_release(self, key, protocol, should_close=should_close)  # no super() object
        if protocol.transport is not None:  # kept (a closed one's transport is None)
            protocol.pooled = True  # type: ignore[attr-defined]  # UpstreamProtocol: see data_received

    async def _wait_for_available_connection(self, key: Any, traces: list[Trace]) -> None:
        watcher = _watcher(traces)
        if watcher is None:
            await super()._wait_for_available_connection(key, traces)
            return
        watcher.wait_for_connection(True)
        self.waiting += 1
        try:
            await super()._wait_for_available_connection(key, traces)
        finally:
            self.waiting -= 1
        # Not in a `finally`: a request cancelled while waiting stays "queued", so
        # it is known never to have been sent (no attempt is counted).
        watcher.wait_for_connection(False)

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
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from aiohttp.client_proto import ResponseHandler

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
        self.received = True
        _handler_data_received(self, data)  # no super() object per chunk
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

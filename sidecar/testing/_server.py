"""aiohttp plumbing of the fake upstream: counting TCP accepts, sending faulty responses."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web
from multidict import CIMultiDict

from .fault import ReceivedRequest
from .net import LOOPBACK
from .render import Body, gzip_chunks

__all__ = ["CountingProtocol", "CountingSite", "send_response"]


class CountingProtocol(asyncio.Protocol):
    """Wraps aiohttp's ``RequestHandler`` (the protocol ``web.Server()`` makes) and
    reports each accepted and lost TCP connection; everything else is delegated."""

    def __init__(
        self,
        inner: asyncio.Protocol,
        on_made: Callable[[asyncio.Transport], None],
        on_lost: Callable[[asyncio.Transport], None],
    ) -> None:
        self._inner, self._on_made, self._on_lost = inner, on_made, on_lost
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._on_made(self._transport)
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            if self._transport is not None:
                self._on_lost(self._transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class CountingSite(web.BaseSite):
    """A TCP site on 127.0.0.1 serving through our own protocol factory.

    Registered with the runner like ``web.TCPSite``, so ``runner.cleanup()``
    stops it; ``bound_port`` is the real port after ``start()``.
    """

    __slots__ = ("_factory", "_port", "_tls", "bound_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        port: int,
        factory: Callable[[], asyncio.Protocol],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner)
        self._port, self._factory, self.bound_port, self._tls = port, factory, port, tls

    @property
    def name(self) -> str:
        scheme = "http" if self._tls is None else "https"
        return f"{scheme}://{LOOPBACK}:{self.bound_port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(self._factory, LOOPBACK, self._port, ssl=self._tls)
        self._server = server
        self.bound_port = server.sockets[0].getsockname()[1]


async def pause(ms: float, gate: asyncio.Event | None = None) -> None:
    """Sleep ``ms`` milliseconds (if > 0), then wait for ``gate`` (if any)."""
    if ms > 0:
        await asyncio.sleep(ms / 1000)
    if gate is not None:
        await gate.wait()


async def reset_connection(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Flush what was written into the kernel, then abort the connection.

    ``transport.abort()`` drops asyncio's write buffer, so a non-empty buffer is
    drained first (write-buffer limit 0 pauses the protocol until it is empty).
    The socket is then closed: the peer gets a FIN after the bytes sent, no RST
    (the request was read completely). Returning ``resp`` lets aiohttp finish
    quietly: its ``write_eof()`` on the closing transport raises
    ``ConnectionResetError``, which aiohttp takes for a client disconnect.
    """
    transport = request.transport
    if transport is not None and not transport.is_closing():
        if transport.get_write_buffer_size():
            transport.set_write_buffer_limits(high=0)
            await request.writer.drain()
        transport.abort()
    return resp


async def send_response(
    request: web.Request,
    rec: ReceivedRequest,
    body: Body,
    wait_released: Callable[[], Awaitable[None]],
) -> web.StreamResponse:
    """Answer ``request`` with ``body``, applying ``rec.fault`` step by step (see
    :class:`~sidecar.testing.Fault`); ``wait_released`` is the stall's wait."""
    f, (ctype, chunks, sse, status) = rec.fault, body
    headers = CIMultiDict(
        {"Content-Type": f.content_type or ctype, "x-fake-request": str(rec.index)}
    )
    if sse:
        headers["Cache-Control"] = "no-cache"
    if f.retry_after is not None:
        headers["Retry-After"] = f.retry_after
    if f.gzip and chunks:
        chunks = gzip_chunks(chunks)
        headers["Content-Encoding"] = "gzip"
    if not sse:
        headers["Content-Length"] = str(sum(map(len, chunks)))
    headers.update(f.headers)
    resp = web.StreamResponse(status=status or f.status, headers=headers)
    if not f.keep_alive:
        resp.force_close()
    if f.reset_before_headers:
        return await reset_connection(request, resp)
    await pause(f.delay_headers_ms, f.hold_headers)
    try:
        await resp.prepare(request)  # StreamResponse sends status + headers right away
        if f.reset_after_headers:
            return await reset_connection(request, resp)
        stall_at = 0 if f.stall else f.stall_after_chunks
        hold_at, hold = f.hold_after_chunks or (None, None)
        for i in range(len(chunks) + 1):
            if i == 0:
                await pause(f.delay_first_chunk_ms, f.hold_first_chunk)
            elif i < len(chunks):
                await pause(f.chunk_delay_ms)
            if i == hold_at:
                await pause(0, hold)
            if i == stall_at:
                await wait_released()
            if i == f.reset_after_chunks:
                return await reset_connection(request, resp)
            if i < len(chunks):
                await resp.write(chunks[i])
        await resp.write_eof()
    except ConnectionError:
        pass  # the client went away; aiohttp ends the connection quietly
    return resp

"""After the commit point: a chunked stream's bytes go to the client as they arrive.

The pull pump (``await content.readany()`` then a write) costs a stream, per
upstream chunk: a waiter future, its wake-up of the relay task one event-loop
iteration later (one more ``epoll_wait``), the task step and the coroutine
frames of ``readany``. :class:`PushPump` writes each chunk to the client from
the upstream connection's own ``data_received`` instead, in the same callback
that parsed it: :class:`sidecar.wire.pool.UpstreamProtocol` calls :meth:`PushPump.pump`
after aiohttp's parser has fed the response's :class:`aiohttp.StreamReader`, and
the pump takes the bytes out with the reader's public ``read_nowait``. The relay
task sleeps until the stream ends, fails, or the client stops reading.

What stays as it was (``tests/e2e/test_stream_pump.py``, ``test_relay_failures.py``):

* the bytes and their chunked framing (RFC 9112 section 7.1): one chunk per
  ``read_nowait``, as the pull pump wrote one per ``readany``;
* backpressure: when the client's transport pauses writing (its buffer is over
  the transport's high-water mark), the pump stops taking bytes; they stay in the
  reader, which pauses the upstream's reads at its own high-water mark (aiohttp's
  flow control), until the relay task's ``drain`` returns and pumps again; a
  pump that empties a reader which paused the upstream resumes its reads;
* a client gone (its transport closing) ends the stream with
  :class:`ConnectionResetError`; an upstream failure with the reader's exception
  (aiohttp's :class:`aiohttp.ClientPayloadError` and kin);
* what the relay does per chunk (the idle deadline's touch, the usage scan) is one
  callback, ``on_chunk(chunk)``, called after the chunk is written; a deadline's
  cancellation of the relay task ends the stream as it did.

The pump detaches itself from the protocol at the stream's end, in the callback
that saw it: aiohttp gives the connection back to the pool at the end of the
payload, and its next response must not be pumped here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp.http import StreamWriter

from sidecar.wire.pool import UpstreamProtocol


class PushPump:
    """Pushes ``content``'s bytes to the client's ``transport`` in chunked framing.

    :param proto: the upstream connection's protocol; :meth:`run` attaches the pump
        to it (``proto.push``) and detaches it. None when the connection already
        went back to the pool: the rest of the body is in the reader, and the pump
        only empties it.
    :param content: the committed response's body reader (``response.content``).
    :param request: the client's request (its transport and writer).
    :param on_chunk: called with each chunk once it is written to the client.
    """

    __slots__ = (
        "_blocked", "_content", "_ended", "_error", "_on_chunk",
        "_proto", "_pumping", "_server", "_transport", "_waiter",
    )  # fmt: skip

    def __init__(
        self,
        proto: UpstreamProtocol | None,
        content: aiohttp.StreamReader,
        request: aiohttp.web.BaseRequest,
        on_chunk: Callable[[bytes], None],
    ) -> None:
        self._proto = proto
        self._content = content
        self._transport = request.transport
        self._server = request.protocol
        self._on_chunk = on_chunk
        self._waiter: asyncio.Future[None] | None = None
        self._pumping = False
        self._blocked = False
        self._error: BaseException | None = None
        self._ended = False

    async def run(self, drain: Callable[[], Awaitable[None]]) -> None:
        """Relay ``content`` to its end (the relay task's side).

        :param drain: the client writer's ``drain`` coroutine function (waits while
            the client's transport has paused writing).
        :raises ConnectionResetError: the client's transport is closing.
        :raises aiohttp.ClientError | OSError: the upstream failed mid-stream (the
            reader's exception).
        :raises asyncio.CancelledError: the task was cancelled (the idle deadline).
        """
        if self._transport is None:
            raise ConnectionResetError("client gone")
        loop = asyncio.get_running_loop()
        proto = self._proto
        if proto is not None:
            proto.push = self
        # The reader's own reads resume the upstream's reading whenever it holds
        # less than its low-water mark: a ``resume_reading`` per chunk, and with it a
        # second pass of the parser over no bytes (~7k instructions per chunk). The
        # pump empties the reader on every call and resumes the upstream itself
        # when the reader had paused it (while the client was not draining, or past
        # the reader's high-water mark of HTTP chunks within one read:
        # ``tests/e2e/test_push_pump_bursts.py``). ``tests/unit/test_push_pump.py``
        # pins the reader's steps this relies on.
        self._content._low_water = -1
        try:
            self.pump()
            while not self._ended:
                if self._blocked:
                    await drain()
                    self._blocked = False
                    self.pump()  # resumes the upstream's reading if it was paused
                    continue
                self._waiter = waiter = loop.create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
            if self._error is not None:
                raise self._error
        finally:
            if proto is not None and proto.push is self:
                proto.push = None

    def pump(self) -> None:
        """Write what the reader holds now to the client (the connection's side).

        Called from the upstream protocol's ``data_received`` and
        ``connection_lost``, and by :meth:`run`. Re-entrant calls (the reader's
        ``resume_reading`` feeds the parser again from inside ``read_nowait``)
        return at once; the outer call's loop takes their bytes.
        """
        if self._pumping or self._ended or self._blocked:
            return
        self._pumping = True
        try:
            content, transport, on_chunk = self._content, self._transport, self._on_chunk
            assert transport is not None
            proto = self._proto
            while True:
                try:
                    chunk = content.read_nowait()
                except Exception as exc:  # the upstream failed: the reader's error
                    self._end(exc)
                    return
                if not chunk:
                    if proto is not None and proto._reading_paused and not content.is_eof():
                        # The reader paused the upstream (over its high-water mark
                        # of bytes or of HTTP chunks, even within one read) and is
                        # empty now: resume it, as a read above the low-water mark
                        # would. Its parser feeds the rest of that read into the
                        # reader from inside this call (the nested pump returns).
                        proto.resume_reading()
                        continue
                    break
                if transport.is_closing():
                    self._end(ConnectionResetError("Cannot write to closing transport"))
                    return
                transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                on_chunk(chunk)
                if self._server.writing_paused:
                    self._blocked = True
                    self._wake()
                    return
            if content.is_eof():
                self._end(None)
        finally:
            self._pumping = False

    def _end(self, error: BaseException | None) -> None:
        self._ended = True
        self._error = error
        proto = self._proto
        if proto is not None and proto.push is self:
            proto.push = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


async def send_rest(
    request: aiohttp.web.BaseRequest,
    response: aiohttp.ClientResponse,
    on_chunk: Callable[[bytes], None],
) -> None:
    """After the head and the first bytes went out (``StreamResponse.prepare`` and a
    write), relay the rest of ``response``'s body to the client.

    A chunked answer to the client is pushed from the upstream connection's own data
    callback (:class:`PushPump`); an HTTP/1.0 client's, or one that keeps the
    upstream's ``Content-Length``, is pulled and written chunk by chunk.
    ``on_chunk(chunk)`` is called after each chunk is written.

    :raises ConnectionResetError: the client went away.
    :raises aiohttp.ClientError | OSError: the upstream failed mid-body.
    :raises asyncio.CancelledError: the task was cancelled (a deadline).
    """
    writer = request.writer
    content = response.content
    if isinstance(writer, StreamWriter) and writer.chunked and writer.length is None:
        # The connection is None once it went back to the pool: the rest of the body
        # is in the reader already, and the pump only empties it.
        conn = response.connection
        proto = conn.protocol if conn is not None else None
        assert proto is None or isinstance(proto, UpstreamProtocol)
        await PushPump(proto, content, request, on_chunk).run(writer.drain)
        return
    write = writer.write
    while chunk := await content.readany():
        await write(chunk)
        on_chunk(chunk)

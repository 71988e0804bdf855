"""The byte pump after the commit point: backpressure, framing, HTTP/1.0 clients.

A stream's chunks after its first output go straight to the client's transport in
chunked framing (``sidecar.wire.push_pump.PushPump``). What a user must see: the same
bytes as the upstream sent; a client that stops reading stops the upstream's
reads (the sidecar does not buffer the stream for it); an HTTP/1.0 client gets the
stream unchunked, ended by the close.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from tests.app_upstream import serve_post
from tests.configs import single
from tests.conftest import StartSidecar

CHAT = "/v1/chat/completions"
EVENT_TEXT = 16 * 1024
GUARD_S = 20.0


def event(i: int) -> bytes:
    """One chat-completion chunk event carrying ~16 KiB of output (index ``i``)."""
    delta = {"choices": [{"index": 0, "delta": {"content": f"{i:08d}" + "x" * EVENT_TEXT}}]}
    return b"data: " + orjson.dumps(delta) + b"\n\n"


class BigStream:
    """A real aiohttp upstream streaming ``events`` large SSE events, counting bytes written."""

    def __init__(self, events: int) -> None:
        self.events = events
        self.written = 0
        self.done = asyncio.Event()
        self.progress = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    def body(self) -> bytes:
        return b"".join(event(i) for i in range(self.events)) + b"data: [DONE]\n\n"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.events):
            chunk = event(i)
            await resp.write(chunk)  # waits while the sidecar does not read
            self.written += len(chunk)
            self.progress.set()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.done.set()
        return resp

    async def start(self) -> None:
        self.runner, self.url = await serve_post(CHAT, self.handle)


@pytest_asyncio.fixture
async def big() -> AsyncIterator[BigStream]:
    upstream = BigStream(events=1536)  # ~24 MiB
    await upstream.start()
    yield upstream
    assert upstream.runner is not None
    await upstream.runner.cleanup()


def request_bytes(version: str) -> bytes:
    body = b'{"model":"gpt-4o","stream":true}'
    return (
        f"POST {CHAT} HTTP/{version}\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def unchunk(data: bytes) -> bytes:
    """The payload of a chunked body (RFC 9112 section 7.1), which must end with its last chunk."""
    out: list[bytes] = []
    pos = 0
    while True:
        line_end = data.index(b"\r\n", pos)
        size = int(data[pos:line_end], 16)
        if size == 0:
            assert data[line_end:] == b"\r\n\r\n"
            return b"".join(out)
        out.append(data[line_end + 2 : line_end + 2 + size])
        assert data[line_end + 2 + size : line_end + 4 + size] == b"\r\n"
        pos = line_end + 4 + size


async def test_a_client_that_stops_reading_stops_the_upstream_then_gets_every_byte(
    big: BigStream, start_sidecar: StartSidecar
) -> None:
    sc = await start_sidecar(single(big.url))
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.proxy_port, limit=2**16)
    try:
        writer.write(request_bytes("1.1"))
        async with asyncio.timeout(GUARD_S):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert b"Transfer-Encoding: chunked" in head
            # The client reads nothing more; the upstream gets going...
            while big.written < 2**20:
                big.progress.clear()
                await big.progress.wait()
        # ...and must stall far short of its end: only socket buffers and the
        # sidecar's 64 KiB between two drains hold what the client has not read.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await big.done.wait()
        assert big.written < 16 * 2**20
        async with asyncio.timeout(GUARD_S):
            rest = await _read_chunked(reader)
        assert unchunk(rest) == big.body()
        assert big.done.is_set()
    finally:
        writer.close()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = await reader.read(2**20)
        assert chunk, "the sidecar closed the stream before its last chunk"
        data += chunk
    return data


async def test_an_http_1_0_client_gets_the_stream_unchunked_ended_by_the_close(
    start_sidecar: StartSidecar,
) -> None:
    upstream = BigStream(events=40)
    await upstream.start()
    try:
        sc = await start_sidecar(single(upstream.url))
        reader, writer = await asyncio.open_connection("127.0.0.1", sc.proxy_port)
        try:
            writer.write(request_bytes("1.0"))
            async with asyncio.timeout(GUARD_S):
                answer = await reader.read(-1)  # until the sidecar closes
        finally:
            writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200")
        assert b"chunked" not in head.lower()
        assert body == upstream.body()
    finally:
        assert upstream.runner is not None
        await upstream.runner.cleanup()


async def test_an_http_1_0_keep_alive_client_gets_the_stream_ended_by_the_close(
    start_sidecar: StartSidecar,
) -> None:
    # An HTTP/1.0 body without a length is delimited only by the close (RFC 1945
    # section 7.2.2): the sidecar must close even when the client asked for keep-alive,
    # or the client waits forever and the next answer's head lands in this body.
    upstream = BigStream(events=4)
    await upstream.start()
    try:
        sc = await start_sidecar(single(upstream.url))
        reader, writer = await asyncio.open_connection("127.0.0.1", sc.proxy_port)
        request = request_bytes("1.0").replace(
            b"Host: sidecar\r\n", b"Host: sidecar\r\nConnection: keep-alive\r\n"
        )
        try:
            writer.write(request)
            async with asyncio.timeout(5.0):
                answer = await reader.read(-1)  # until the sidecar closes
        finally:
            writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200")
        assert b"keep-alive" not in head.lower()
        assert body == upstream.body()
    finally:
        assert upstream.runner is not None
        await upstream.runner.cleanup()

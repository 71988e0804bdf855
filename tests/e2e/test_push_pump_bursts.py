"""A pushed stream whose upstream sends much at once: one TCP read holding a burst.

aiohttp's response reader pauses the upstream connection's reading (and its parser)
inside the data callback once it holds more than its high-water mark of bytes, or of
HTTP chunks (``limit // 16``: 16384 at the default 256 KiB read buffer). A reader whose
bytes are taken resumes it again. Bursts like these are common: an upstream that
flushes a token per chunk, behind a proxy or a slow link, lands thousands of tiny
chunks in one read. What a client must see: every byte, and the stream's end, with
no wait for the idle deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest_asyncio
from aiohttp import web

from sidecar.testing import shapes
from tests.app_upstream import serve_post
from tests.configs import single
from tests.conftest import StartSidecar

CHAT = "/v1/chat/completions"
GUARD_S = 5.0
EVENTS = shapes.chat_completion_stream("gpt-4o", ["a", "b"], rid="chatcmpl-burst")
"""role-only, "a" (the commit point), "b", finish, [DONE]."""


def framed(data: bytes, size: int) -> bytes:
    """``data`` in chunked framing (RFC 9112 section 7.1), ``size`` bytes per chunk."""
    parts = (data[i : i + size] for i in range(0, len(data), size))
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts)


class BurstStream:
    """A real aiohttp upstream: the first two events, then (after ``gate``) ``burst``
    in ``chunk``-byte chunks with one socket write, then the rest of ``EVENTS``."""

    def __init__(self, burst: bytes, chunk: int) -> None:
        self.burst = burst
        self.chunk = chunk
        self.gate = asyncio.Event()
        self.url = ""
        self.runner: web.AppRunner | None = None

    def body(self) -> bytes:
        return b"".join(EVENTS[:2]) + self.burst + b"".join(EVENTS[2:])

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(EVENTS[0] + EVENTS[1])
        await self.gate.wait()
        assert request.transport is not None
        request.transport.write(framed(self.burst, self.chunk))  # one write: one read
        for event in EVENTS[2:]:
            await resp.write(event)
        await resp.write_eof()
        return resp

    async def start(self) -> None:
        self.runner, self.url = await serve_post(CHAT, self.handle)


async def burst_upstream(burst: bytes, chunk: int) -> AsyncIterator[BurstStream]:
    upstream = BurstStream(burst, chunk)
    await upstream.start()
    yield upstream
    upstream.gate.set()
    assert upstream.runner is not None
    await upstream.runner.cleanup()


@pytest_asyncio.fixture
async def tiny_chunks() -> AsyncIterator[BurstStream]:
    """One event sent a byte per chunk: 40000 chunks (~240 KB) in one read."""
    async for upstream in burst_upstream(b"data: " + b"y" * 39992 + b"\n\n", 1):
        yield upstream


async def relay_all(url: str, upstream: BurstStream, http: aiohttp.ClientSession) -> bytes:
    async with http.post(url, json={"model": "gpt-4o", "stream": True}) as r:
        assert r.status == 200
        async with asyncio.timeout(GUARD_S):
            got = await r.content.readuntil(b"\n\n")
            got += await r.content.readuntil(b"\n\n")  # committed: "a" is out
            upstream.gate.set()
            got += await r.read()
    return got


async def test_thousands_of_tiny_chunks_in_one_read_all_reach_the_client(
    tiny_chunks: BurstStream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(single(tiny_chunks.url, idle_timeout_ms=1000))
    got = await relay_all(sc.proxy_url + CHAT, tiny_chunks, http)
    assert got == tiny_chunks.body()

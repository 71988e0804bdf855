"""The resend-once rule on a reused keep-alive connection (contract, "The commit point").

"A request that fails on a reused keep-alive connection before any response byte
... is resent once on a new connection." Only then: an upstream that began its
answer and broke off mid-head has seen (and may bill) the request, so it is a
broken response for the retry rules, not a silent resend.

A raw asyncio server on 127.0.0.1 answers the first request whole and keeps the
connection open, then answers the second request on that same connection with
``partial`` (possibly nothing) and closes it.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.configs import single
from tests.conftest import StartSidecar

CHAT = "/v1/chat/completions"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)


class SecondBreaks:
    """Counts requests; the second one on the first connection gets ``partial``, then a close.

    Every request on a later connection gets a whole 200.
    """

    def __init__(self, partial: bytes) -> None:
        self.partial = partial
        self.requests = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first_connection = self.connections == 1
        served = 0
        try:
            while True:
                await _read_request(reader)
                self.requests += 1
                served += 1
                if first_connection and served == 2:
                    writer.write(self.partial)
                    await writer.drain()
                    return
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _two_requests(
    partial: bytes, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> tuple[SecondBreaks, int, str | None]:
    upstream = SecondBreaks(partial)
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        sc = await start_sidecar(single(url, retry={"max_retries": 0}))
        async with http.post(sc.proxy_url + CHAT, data=b"{}") as r:
            assert r.status == 200
            assert await r.read() == b"ok"
        async with http.post(sc.proxy_url + CHAT, data=b"{}") as r:
            await r.read()
            return upstream, r.status, r.headers.get("x-sidecar-attempts")
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "partial",
    [b"H", b"HTTP/1.1 20", b"HTTP/1.1 200 OK\r\nX-Request-Id: ab"],
    ids=["one-byte", "status-line", "mid-headers"],
)
async def test_an_answer_cut_mid_head_on_a_reused_connection_is_not_resent(
    partial: bytes, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    upstream, status, attempts = await _two_requests(partial, start_sidecar, http)
    assert upstream.requests == 2  # the broken request was sent once, never resent
    assert status == 502
    assert attempts == "1"


async def test_a_reused_connection_closed_before_any_byte_is_resent_once(
    start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    upstream, status, attempts = await _two_requests(b"", start_sidecar, http)
    assert upstream.requests == 3  # resent once, on a new connection
    assert upstream.connections == 2
    assert status == 200
    assert attempts == "1"  # the dropped try is not an attempt

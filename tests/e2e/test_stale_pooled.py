"""A pooled upstream connection that received bytes while idle is never reused.

Contract, "The proxy port": some servers write ``HTTP/1.1 408 Request Timeout`` (with
``Connection: close``) on a keep-alive connection that sat idle, then close it. Before,
the next request that took that connection from the pool read the 408 as its own
answer: it failed, and the healthy upstream's breaker counted it (``http_408``).
"""

from __future__ import annotations

import asyncio
import itertools

import aiohttp

from sidecar.testing import FakeClock
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar, status
from tests.rawhttp import RawHandler, RawUpstream

CHAT = "/v1/chat/completions"
OK = b'{"object":"chat.completion","choices":[{"message":{"content":"hi"}}]}'
STALE = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
WAIT_S = 5.0


async def read_request(reader: asyncio.StreamReader) -> bool:
    """Read one request (head and Content-Length body); False at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":", 1)[1]))
    return True


def upstream_408_when_idle(go: asyncio.Event, stale_sent: asyncio.Event) -> RawHandler:
    """Connection 1: one answer, then (once ``go`` is set) an unsolicited 408 while idle,
    kept open until the peer closes it. Later connections: a 200 to every request."""
    counter = itertools.count(1)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = next(counter)
        while await read_request(reader):
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(OK), OK)
            )
            await writer.drain()
            if n == 1:
                await go.wait()
                writer.write(STALE)
                await writer.drain()
                stale_sent.set()
        writer.close()

    return handler


async def test_bytes_received_while_pooled_are_never_taken_as_an_answer(
    raw_upstream: RawUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    go, stale_sent = asyncio.Event(), asyncio.Event()
    url = await raw_upstream(upstream_408_when_idle(go, stale_sent))
    sc = await start_sidecar(
        config(
            upstreams={
                "primary": upstream(
                    url, retry={"max_retries": 0}, circuit_breaker={"failure_threshold": 1}
                )
            },
            routes=[route("chat", "primary", path_prefix="/v1/")],
        )
    )
    async with asyncio.timeout(WAIT_S):
        async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
            assert (r.status, await r.read()) == (200, OK)
        go.set()  # the connection is back in the sidecar's pool: the upstream goes stale
        await stale_sent.wait()
        async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
            assert (r.status, await r.read()) == (200, OK)
            assert r.headers["x-sidecar-attempts"] == "1"
    entry = (await status(http, sc))["primary/*"]
    assert (entry["state"], entry["consecutive_failures"]) == ("closed", 0)

"""Review of the hot-path changes: one RetryClient per upstream (the current candidate
call passed through a ContextVar), the single-write relay of a whole body, and the
no-timer read of a request body that came with its head.

Black-box through the running sidecar; raw asyncio servers and sockets on 127.0.0.1
where the exact bytes matter.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from sidecar.testing import FakeUpstream, Fault
from tests.configs import single
from tests.conftest import StartSidecar
from tests.rawhttp import RawConn, RawUpstream

CHAT = "/v1/chat/completions"
WAIT_S = 5.0


# One upstream ``primary`` (no breaker), one route over it, built by ``single``.
SERVER = {"drain_timeout_ms": 200}
RETRY = {
    "max_retries": 2,
    "backoff_initial_ms": 100,
    "backoff_max_ms": 100,
    "retry_after_max_ms": 60000,
}


async def test_concurrent_calls_on_one_upstream_each_follow_their_own_retries(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """Every call on an upstream shares one RetryClient and one retry-options object;
    the call an attempt or a backoff belongs to comes from a ContextVar. Two calls in
    flight at once, the later one started last, must each see their own: A's 503 asks
    for a Retry-After beyond ``retry_after_max_ms`` (give up, relay it after one
    attempt), B's 503 is retried after its backoff and then succeeds.
    """
    gate_a, gate_b = asyncio.Event(), asyncio.Event()
    fake.script_for_model("a", [Fault(status=503, retry_after="120", hold_headers=gate_a)])
    fake.script_for_model("b", [Fault(status=503, hold_headers=gate_b), Fault(text="b ok")])
    sc = await start_sidecar(single(fake.url, server=SERVER, retry=RETRY))
    async with asyncio.timeout(WAIT_S):
        a = asyncio.create_task(http.post(sc.proxy_url + CHAT, json={"model": "a"}))
        await fake.wait_for_requests(1)
        b = asyncio.create_task(http.post(sc.proxy_url + CHAT, json={"model": "b"}))
        await fake.wait_for_requests(2)
        gate_a.set()  # A's 503 comes back while B's call (started last) is in flight
        ra = await a
        gate_b.set()
        rb = await b
        body_a, body_b = await ra.read(), await rb.read()
    assert ra.status == 503, body_a
    assert ra.headers["x-sidecar-attempts"] == "1"
    assert rb.status == 200, body_b
    assert rb.headers["x-sidecar-attempts"] == "2"
    assert b"b ok" in body_b
    assert [r.model for r in fake.requests] == ["a", "b", "b"]


async def test_whole_body_in_one_write_keeps_the_upstream_head_and_bytes(
    raw_upstream: RawUpstream, start_sidecar: StartSidecar
) -> None:
    """An answer whose whole body came in the first read is sent as one response:
    status and reason, duplicate ``Set-Cookie`` in order, ``Content-Encoding`` and the
    encoded bytes with the upstream's ``Content-Length``, nothing decoded or reframed.
    """
    gz = bytes.fromhex("1f8b08000000000000ff") + b"\x00opaque\xff"

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                await reader.readexactly(int(line.split(b":", 1)[1]))
        writer.write(
            b"HTTP/1.1 201 Made It\r\n"
            b"Set-Cookie: a=1\r\nX-Z: z\r\nSet-Cookie: b=2\r\n"
            b"Content-Encoding: gzip\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(gz) + gz
        )
        await writer.drain()

    url = await raw_upstream(upstream)
    sc = await start_sidecar(single(url, server=SERVER, retry=RETRY))
    port = int(sc.proxy_url.rsplit(":", 1)[1])
    body = b'{"model":"m"}'
    async with await RawConn.open(port) as conn:
        await conn.send(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (CHAT.encode(), len(body), body)
        )
        resp = await conn.response()
    assert resp.status == 201
    assert resp.headers.getall("Set-Cookie") == ["a=1", "b=2"]
    assert resp.headers["X-Z"] == "z"
    assert resp.headers["Content-Encoding"] == "gzip"
    assert resp.headers["Content-Length"] == str(len(gz))
    assert "Transfer-Encoding" not in resp.headers
    assert resp.body == gz


@pytest.mark.parametrize(("size", "expected"), [(10, 200), (11, 413)])
async def test_chunked_body_that_came_with_its_head_is_held_to_the_limit(
    fake: FakeUpstream, start_sidecar: StartSidecar, size: int, expected: int
) -> None:
    """A chunked body (no Content-Length to check first) sent with its head in one
    write takes the no-timer read; it is still refused past
    ``max_request_body_bytes`` and relayed byte for byte within it.
    """
    sc = await start_sidecar(
        single(fake.url, server={**SERVER, "max_request_body_bytes": 10}, retry=RETRY)
    )
    port = int(sc.proxy_url.rsplit(":", 1)[1])
    body = b"x" * size
    async with await RawConn.open(port) as conn:
        await conn.send(
            b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x\r\n%s\r\n0\r\n\r\n" % (size, body)
        )
        resp = await conn.response()
    assert resp.status == expected, resp.body
    if expected == 200:
        assert fake.requests[-1].body == body
    else:
        assert fake.request_count == 0

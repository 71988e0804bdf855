"""The relay's whole-answer send (``whole_answer.send_whole``) and the skipped
``release()`` of a finished answer, end to end: framing and the upstream pool.

Raw asyncio upstreams and sockets on 127.0.0.1, where the exact framing matters.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from sidecar.testing import FakeUpstream, Fault
from tests.configs import single
from tests.conftest import StartSidecar
from tests.rawhttp import RawConn, RawHandler, RawUpstream

CHAT = "/v1/chat/completions"
WAIT_S = 5.0
SERVER = {"drain_timeout_ms": 200}
RETRY = {"max_retries": 0}


def answering(head: bytes, body: bytes) -> RawHandler:
    """A keep-alive upstream that answers every request with ``head`` + ``body``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                req = await reader.readuntil(b"\r\n\r\n")
                for line in req.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":", 1)[1]))
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return handler


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
async def test_upstream_naming_content_length_in_connection_still_frames_the_answer(
    raw_upstream: RawUpstream,
    start_sidecar: StartSidecar,
    version: bytes,
) -> None:
    """An upstream answer with ``Connection: Content-Length`` loses its Content-Length
    to the hop-by-hop rule; the client must still get a framed answer (a length it
    can read to, then the connection usable for a second request), as web.Response
    gave it (it sets Content-Length from the body).
    """
    body = b'{"ok":true}'
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Connection: Content-Length\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    url = await raw_upstream(answering(head, body))
    sc = await start_sidecar(single(url, server=SERVER, retry=RETRY))
    port = int(sc.proxy_url.rsplit(":", 1)[1])
    req = b'{"model":"m"}'
    keep = b"Connection: keep-alive\r\n" if version == b"1.0" else b""
    async with await RawConn.open(port) as conn:
        for _ in range(2):
            await conn.send(
                b"POST %s HTTP/%s\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), version, keep, len(req), req)
            )
            async with asyncio.timeout(WAIT_S):
                raw_head = await conn.reader.readuntil(b"\r\n\r\n")
            assert b"\r\ncontent-length: %d\r\n" % len(body) in raw_head.lower(), raw_head
            async with asyncio.timeout(WAIT_S):
                got = await conn.reader.readexactly(len(body))
            assert got == body


async def test_one_pooled_connection_serves_whole_streamed_and_abandoned_answers(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """``max_connections = 1``: whole JSON answers, a streamed answer, a client that
    left before its whole answer was written, then more answers: each one gives the
    single upstream connection back (a leaked slot would hold the next request)."""
    gate = asyncio.Event()
    fake.script(
        [
            Fault(text="a"),
            Fault(text="b"),
            Fault(text="left", hold_headers=gate),
            Fault(text="c"),
            Fault(text="d"),
        ]
    )
    sc = await start_sidecar(single(fake.url, server=SERVER, retry=RETRY, max_connections=1))
    port = int(sc.proxy_url.rsplit(":", 1)[1])
    req = b'{"model":"m","messages":[]}'
    async with asyncio.timeout(WAIT_S):
        r = await http.post(sc.proxy_url + CHAT, json={"model": "m"})
        assert r.status == 200 and b"a" in await r.read()
        r = await http.post(sc.proxy_url + CHAT, json={"model": "m", "stream": True})
        streamed = await r.read()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        assert b"data: " in streamed and b"b" in streamed
        async with await RawConn.open(port) as conn:
            await conn.send(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(req), req)
            )
            await fake.wait_for_requests(3)
        gate.set()  # the client is gone; its whole answer arrives now
        for text in (b"c", b"d"):
            r = await http.post(sc.proxy_url + CHAT, json={"model": "m"})
            assert r.status == 200 and text in await r.read()
    assert len(fake.requests) == 5

"""An upstream body with neither Content-Length nor chunked framing ends at a clean close.

Contract, "The proxy port": such a body (HTTP/1.0 servers, some proxies) ends at the
connection's FIN; a reset before that is a cut like any other, so after the commit
point the client connection is aborted, never ended as if complete. Before, aiohttp's
parser took the reset as the body's end and the client got a clean chunked end.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import aiohttp
import pytest

from tests.configs import single
from tests.conftest import StartSidecar
from tests.rawhttp import RawHandler, RawUpstream

CHAT = "/v1/chat/completions"
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
WAIT_S = 5.0


def close_delimited(part: bytes, go: asyncio.Event, *, reset: bool) -> RawHandler:
    """Head, ``part``, then (once ``go`` is set) a reset, or the rest and a FIN."""

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                await reader.readexactly(int(line.split(b":", 1)[1]))
        writer.write(HEAD + part)
        await writer.drain()
        await go.wait()  # the client has the first bytes: the answer is committed
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # RST
        else:
            writer.write(b" and the rest")
            await writer.drain()
            writer.close()  # FIN: the body's end

    return upstream


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "fin"])
async def test_a_reset_cuts_a_close_delimited_body_and_a_fin_ends_it(
    raw_upstream: RawUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    reset: bool,
) -> None:
    go = asyncio.Event()
    url = await raw_upstream(close_delimited(b"partial", go, reset=reset))
    sc = await start_sidecar(single(url, retry={"max_retries": 0}))
    async with asyncio.timeout(WAIT_S), http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200
        first = await r.content.readany()
        assert first == b"partial"
        go.set()
        if reset:
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
        else:
            assert await r.read() == b" and the rest"

"""Raw HTTP/1.x over asyncio sockets, for requests no well-behaved client would send.

Every read is bounded by :data:`WAIT_S` (a failure bound, not a pace).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

WAIT_S = 5.0
"""Upper bound on any wait for the server's answer or for it to close the connection."""

RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""A raw upstream's connection handler (``asyncio.start_server``'s callback)."""
RawUpstream = Callable[[RawHandler], Awaitable[str]]
"""The ``raw_upstream`` fixture (``tests/conftest.py``): ``url = await raw_upstream(handler)``."""


@dataclass
class RawResponse:
    """One response as read off the socket."""

    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


class RawConn:
    """One client connection to ``127.0.0.1:port``; use ``async with RawConn.open(port)``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> RawConn:
        """Connect to the loopback ``port``."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def __aenter__(self) -> RawConn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    async def send(self, data: bytes) -> None:
        """Write ``data`` and flush it to the kernel."""
        self.writer.write(data)
        await self.writer.drain()

    async def response(self) -> RawResponse:
        """Read one response: head, then ``Content-Length`` bytes (or up to EOF without one;
        nothing for a 1xx interim answer).

        :raises AssertionError: the connection ended before a complete head.
        :raises TimeoutError: nothing complete within :data:`WAIT_S`.
        """
        async with asyncio.timeout(WAIT_S):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers: CIMultiDict[str] = CIMultiDict()
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers.add(name.strip(), value.strip())
            length = headers.get("Content-Length")
            if 100 <= status < 200:  # an interim answer has no body (RFC 9110 15.2)
                body = b""
            elif length is not None:
                body = await self.reader.readexactly(int(length))
            else:
                body = await self.reader.read()
        return RawResponse(status, headers, body)

    async def closed_by_peer(self) -> bytes:
        """Wait until the server closes the connection; return the bytes read until then.

        A reset or broken pipe counts as closed. :raises TimeoutError: still open after
        :data:`WAIT_S`.
        """
        out = b""
        async with asyncio.timeout(WAIT_S):
            try:
                while chunk := await self.reader.read(65536):
                    out += chunk
            except ConnectionError:
                pass
        return out

    def abort(self) -> None:
        """Drop the connection at once (RST), as a client that vanishes does."""
        transport = self.writer.transport
        if not transport.is_closing():
            transport.abort()


async def exchange_then_closed(port: int, data: bytes) -> RawResponse:
    """Send ``data`` on a new connection; return the response, after checking that
    the server then closed the connection with nothing more sent.

    :raises TimeoutError: no response, or the connection still open, after :data:`WAIT_S`.
    """
    async with await RawConn.open(port) as conn:
        await conn.send(data)
        resp = await conn.response()
        rest = await conn.closed_by_peer()
        assert rest == b"", f"bytes after the response: {rest[:200]!r}"
        return resp

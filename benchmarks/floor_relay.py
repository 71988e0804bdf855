"""The floor relay: a protocol-level asyncio reverse proxy, for reference only.

    python benchmarks/floor_relay.py --port 8082 --upstream-port 8001

What a Python relay costs when it skips aiohttp's server and client objects:
request heads are split at the blank line, bodies framed by Content-Length,
the response bytes are passed through as they arrive (Content-Length, chunked
or close-delimited framing tracked without copying), upstream connections are
pooled, uvloop when installed. Hop-by-hop request headers are dropped and Host
is rewritten; nothing
else (no routing, retries, breaker, metrics, timeouts, error answers). It is
*not* a product candidate: ``overhead.py --with-floor`` runs it as one more
target, to show how much of the sidecar's cost is aiohttp's machinery rather
than the sidecar's own work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import cast

HOP = (
    b"connection:",
    b"keep-alive:",
    b"proxy-connection:",
    b"te:",
    b"trailer:",
    b"upgrade:",
    b"proxy-authorization:",
    b"host:",
)


class Chunks:
    """Finds the end of a chunked body in pass-through bytes (sizes and trailer only)."""

    __slots__ = ("done", "left", "line", "trailer")

    def __init__(self) -> None:
        self.left = 0  # data + CRLF bytes of the current chunk still to pass
        self.line = b""
        self.trailer = False
        self.done = False

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n and not self.done:
            if self.left:
                take = min(self.left, n - i)
                self.left -= take
                i += take
                continue
            j = data.find(b"\n", i)
            if j < 0:
                self.line += data[i:]
                return
            line, self.line, i = self.line + data[i:j], b"", j + 1
            if self.trailer:
                self.done = not line.strip()
                continue
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size:
                self.left = size + 2
            else:
                self.trailer = True


class Upstream(asyncio.Protocol):
    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.buf = b""
        self.head_done = False
        self.length = -1
        self.chunks: Chunks | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self in self.relay.idle:
            self.relay.idle.remove(self)
        client = self.client
        if client is not None and client.transport is not None:
            if self.head_done and self.length < 0 and self.chunks is None:
                client.transport.close()  # close-delimited body: its end
            else:
                client.transport.abort()  # cut short: never end it cleanly

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None or client.transport is None:
            return
        if not self.head_done:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            data, self.buf, self.head_done = self.buf, b"", True
            data_start = end + 4
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                self.length = int(head[i + 17 : j if j >= 0 else None])
            elif b"\r\ntransfer-encoding: chunked" in head:
                self.chunks = Chunks()
            client.transport.write(data)
            body = data[data_start:]
        else:
            client.transport.write(data)
            body = data
        if self.length >= 0:
            self.length -= len(body)
            complete = self.length <= 0
        elif self.chunks is not None:
            self.chunks.feed(body)
            complete = self.chunks.done
        else:
            complete = False
        if complete:
            self.client, self.head_done, self.length, self.chunks = None, False, -1, None
            self.relay.idle.append(self)
            client.done()


class Client(asyncio.Protocol):
    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self.next_request()

    def next_request(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = self.buf[:end].split(b"\r\n")
        length = 0
        out = [lines[0]]
        for line in lines[1:]:
            low = line[:20].lower()
            if low.startswith(b"content-length:"):
                length = int(line[15:])
            elif low.startswith(b"transfer-encoding:"):
                assert self.transport is not None
                self.transport.write(b"HTTP/1.1 411 Length Required\r\nContent-Length: 0\r\n\r\n")
                self.transport.close()
                return
            if not low.startswith(HOP):
                out.append(line)
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        out.append(self.relay.host_line)
        request = b"\r\n".join(out) + b"\r\n\r\n" + body
        self.busy = True
        idle = self.relay.idle
        while idle:
            up = idle.pop()
            if up.transport is not None and not up.transport.is_closing():
                up.client = self
                up.transport.write(request)
                return
        asyncio.get_running_loop().create_task(self.connect(request))

    async def connect(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(
                lambda: Upstream(self.relay), "127.0.0.1", self.relay.port
            )
        except OSError:
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            self.done()
            return
        up.client = self
        assert up.transport is not None
        up.transport.write(request)

    def done(self) -> None:
        self.busy = False
        if self.buf and self.transport is not None:
            self.next_request()


class Relay:
    def __init__(self, upstream_port: int) -> None:
        self.port = upstream_port
        self.host_line = b"Host: 127.0.0.1:%d" % upstream_port
        self.idle: list[Upstream] = []


async def main(port: int, upstream_port: int) -> None:
    relay = Relay(upstream_port)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(relay), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream-port", type=int, required=True, help="upstream on 127.0.0.1")
    a = p.parse_args()
    try:  # uvloop when installed, as the sidecar does
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main(a.port, a.upstream_port))

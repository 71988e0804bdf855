"""A lean loopback LLM upstream for the benchmarks: raw asyncio HTTP/1.1, no framework.

Why not :class:`sidecar.testing.FakeUpstream`: it parses every body, records every
request and renders each answer, which costs several times the CPU per request
of this server; in ``overhead.py`` the fake would be the bottleneck of the direct
baseline (``overhead.py`` measures both at the start of each run and prints it).

Answers (keep-alive, any path):

* a POST body containing ``"stream": true`` (or ``"stream":true``): an SSE stream
  of ``--sse-chunks`` events (the last one ``data: [DONE]``), chunked encoding,
  one write per event, ``--sse-gap-ms`` between events, the first one after
  ``--sse-first-ms``;
* anything else: a ~500-byte OpenAI ``chat.completion`` JSON with Content-Length.

Modes (for ``outage.py``), switched by a line on stdin, each answered by one line:

* ``mode ok`` / ``mode 503`` (a 503 JSON error) / ``mode sse_error`` (a 200
  event stream whose provider error event comes before any output) / ``mode empty``
  (a 200 empty turn: a ``chat.completion`` whose message content is ``""`` with
  ``"finish_reason":"stop"`` and a usage block; for ``"stream": true`` a role chunk,
  a ``"delta":{}`` chunk with ``"finish_reason":"stop"``, the usage chunk when the
  request asks ``"include_usage": true``, and ``data: [DONE]``, one write per event)
  / ``mode blackhole`` (read the request, never answer a byte) / ``mode refuse``
  (stop listening and abort every connection, so connects are refused; ``mode ok``
  listens again on the same port);
* ``stats``: a JSON line ``{"requests", "by_mode", "accepted", "open", "streams"}``.

Prints ``listening <port>`` once ready; stops on SIGTERM/SIGINT or stdin EOF.
Listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import stat
import sys
import time
from typing import cast

from sidecar.testing import error_shapes

JSON_BODY = json.dumps(
    {
        "id": "chatcmpl-bench0000000000000000000001",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "gpt-4o-2024-08-06",
        "system_fingerprint": "fp_bench",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hello! This is the benchmark upstream answering a chat completion "
                    "request with a short reply of about the size a real model gives to a "
                    "one-line question, so the relay moves realistic amounts of bytes.",
                    "refusal": None,
                },
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 42, "completion_tokens": 48, "total_tokens": 90},
    },
    separators=(",", ":"),
).encode()

ERROR_BODY = (
    b'{"error":{"message":"The server is overloaded or not ready yet.",'
    b'"type":"server_error","param":null,"code":null}}'
)


def _response(status: str, ctype: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: " + ctype + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


JSON_RESPONSE = _response("200 OK", b"application/json", JSON_BODY)
ERROR_RESPONSE = _response("503 Service Unavailable", b"application/json", ERROR_BODY)
SSE_ERROR_RESPONSE = _response(
    "200 OK",
    b"text/event-stream",
    b"".join(error_shapes.openai_error_stream("gpt-4o", "chatcmpl-bench1")),
)
"""A 200 event stream that fails before any output: OpenAI's role-only chunk, then
``data: {"error": {... "type": "server_error"}}`` (byte for byte as the API sends it)."""

# Empty turns, byte for byte as OpenAI sends them: copied from the package's
# sidecar/testing/turn_shapes.py (shapes ``openai_empty_json`` and
# ``openai_empty_stream`` for model gpt-4o, id chatcmpl-bench000001), so this
# server does not depend on that module.
_EMPTY_USAGE_JSON = {
    "prompt_tokens": 1420,
    "completion_tokens": 2,
    "total_tokens": 1422,
    "prompt_tokens_details": {"cached_tokens": 1280, "audio_tokens": 0},
    "completion_tokens_details": {
        "reasoning_tokens": 0,
        "audio_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    },
}
EMPTY_JSON_BODY = (
    json.dumps(
        {
            "id": "chatcmpl-bench000001",
            "object": "chat.completion",
            "created": 1756752811,
            "model": "gpt-4o",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "",
                        "refusal": None,
                        "annotations": [],
                    },
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": _EMPTY_USAGE_JSON,
            "service_tier": "default",
            "system_fingerprint": "fp_51e1070cf2",
        },
        indent=2,
    ).encode()
    + b"\n"
)
"""A ``chat.completion`` whose message content is ``""``, ``"finish_reason":"stop"``:
pretty-printed with two-space indents and a final newline, as the API sends it."""
EMPTY_JSON_RESPONSE = _response("200 OK", b"application/json", EMPTY_JSON_BODY)


def empty_stream_events(include_usage: bool) -> list[bytes]:
    """OpenAI's empty streamed turn, chunked-encoded: the role chunk, ``"delta":{}``
    with ``"finish_reason":"stop"``, (with ``include_usage``: ``"usage":null`` on
    those two and a ``"choices":[]`` usage chunk), ``data: [DONE]``; the last one
    carries the terminating zero-length chunk."""
    head = {
        "id": "chatcmpl-bench000001",
        "object": "chat.completion.chunk",
        "created": 1756752811,
        "model": "gpt-4o",
        "service_tier": "default",
        "system_fingerprint": "fp_51e1070cf2",
    }
    tail = {"usage": None} if include_usage else {}

    def data(doc: dict[str, object]) -> bytes:
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    def chunk(delta: dict[str, object], reason: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return data({**head, "choices": [choice], **tail})

    events = [chunk({"role": "assistant", "content": "", "refusal": None}, None)]
    events.append(chunk({}, "stop"))
    if include_usage:
        usage = {
            **_EMPTY_USAGE_JSON,
            "prompt_tokens": 1203,
            "completion_tokens": 1,
            "total_tokens": 1204,
            "prompt_tokens_details": {"cached_tokens": 1152, "audio_tokens": 0},
        }
        events.append(data({**head, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    out = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
    out[-1] += b"0\r\n\r\n"
    return out


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def sse_events(n: int) -> list[bytes]:
    """``n`` chunked-encoded SSE events: ``n - 1`` chat.completion.chunk deltas, then [DONE]."""
    out = []
    for i in range(n - 1):
        doc = {
            "id": "chatcmpl-bench1",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "gpt-4o",
            "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}],
        }
        out.append(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return [b"%x\r\n%s\r\n" % (len(e), e) for e in out]


EMPTY_STREAM_EVENTS = {False: empty_stream_events(False), True: empty_stream_events(True)}
MODES = ("ok", "503", "sse_error", "empty", "blackhole", "refuse")


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.mode = "ok"
        self.requests = 0
        self.by_mode: dict[str, int] = {}
        self.accepted = 0
        self.streams = 0
        self.conns: set[Conn] = set()
        self.events = sse_events(args.sse_chunks)
        self.gap = args.sse_gap_ms / 1000
        self.first = args.sse_first_ms / 1000
        self.first_ok_after_switch: float | None = None


class Conn(asyncio.Protocol):
    """One client connection: parses requests (Content-Length bodies), answers in order."""

    def __init__(self, st: State) -> None:
        self.st = st
        self.buf = bytearray()
        self.need = -1  # body bytes still expected; -1 while reading headers
        self.busy = False
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.st.accepted += 1
        self.st.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.st.conns.discard(self)
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self.process()

    def process(self) -> None:
        while not self.busy and self.transport is not None:
            if self.need < 0:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end]).lower()
                del self.buf[: end + 4]
                i = head.find(b"\r\ncontent-length:")
                if i >= 0:
                    j = head.find(b"\r\n", i + 2)
                    self.need = int(head[i + 17 : j if j >= 0 else None])
                elif b"\r\ntransfer-encoding:" in head:
                    self.transport.write(_response("411 Length Required", b"text/plain", b""))
                    self.transport.close()
                    return
                else:
                    self.need = 0
            if len(self.buf) < self.need:
                return
            body = bytes(self.buf[: self.need])
            del self.buf[: self.need]
            self.need = -1
            self.answer(body)

    def answer(self, body: bytes) -> None:
        st = self.st
        st.requests += 1
        st.by_mode[st.mode] = st.by_mode.get(st.mode, 0) + 1
        assert self.transport is not None
        if st.mode == "503":
            self.transport.write(ERROR_RESPONSE)
        elif st.mode == "sse_error":
            self.transport.write(SSE_ERROR_RESPONSE)
        elif st.mode == "empty":
            if b'"stream": true' in body or b'"stream":true' in body:
                usage = b'"include_usage": true' in body or b'"include_usage":true' in body
                self.transport.write(SSE_HEAD)
                for ev in EMPTY_STREAM_EVENTS[usage]:  # one write per event
                    self.transport.write(ev)
            else:
                self.transport.write(EMPTY_JSON_RESPONSE)
        elif st.mode == "blackhole":
            self.busy = True  # never answers; the client gives up and closes
        elif b'"stream": true' in body or b'"stream":true' in body:
            if st.first_ok_after_switch is None:
                st.first_ok_after_switch = time.monotonic()
            self.busy = True
            st.streams += 1
            self.task = asyncio.get_running_loop().create_task(self.stream())
        else:
            if st.first_ok_after_switch is None:
                st.first_ok_after_switch = time.monotonic()
            self.transport.write(JSON_RESPONSE)

    async def stream(self) -> None:
        st = self.st
        t = self.transport
        try:
            if t is None:
                return
            t.write(SSE_HEAD)
            if st.first > 0:
                await asyncio.sleep(st.first)
            last = len(st.events) - 1
            for i, ev in enumerate(st.events):
                if self.transport is None:
                    return
                if i == last:
                    t.write(ev + b"0\r\n\r\n")
                else:
                    t.write(ev)
                    if st.gap > 0:
                        await asyncio.sleep(st.gap)
        finally:
            st.streams -= 1
            self.task = None
            self.busy = False
        if self.buf:
            self.process()


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    st = State(args)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def listen(port: int) -> asyncio.Server:
        return await loop.create_server(
            lambda: Conn(st), "127.0.0.1", port, backlog=4096, reuse_address=True
        )

    server: asyncio.Server | None = await listen(args.port)
    assert server is not None
    port = server.sockets[0].getsockname()[1]
    print(f"listening {port}", flush=True)

    reader: asyncio.StreamReader | None = asyncio.StreamReader()
    mode = os.fstat(0).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):  # controlled through a pipe
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    else:  # by hand: no control channel, run until a signal
        reader = None

    async def control() -> None:
        nonlocal server
        if reader is None:
            return
        while line := (await reader.readline()).decode().strip():
            cmd, _, arg = line.partition(" ")
            if cmd == "stats":
                reply = {
                    "requests": st.requests,
                    "by_mode": st.by_mode,
                    "accepted": st.accepted,
                    "open": len(st.conns),
                    "streams": st.streams,
                    "mode": st.mode,
                    "first_ok_after_switch": st.first_ok_after_switch,
                }
                print(json.dumps(reply), flush=True)
                continue
            if cmd != "mode" or arg not in MODES:
                print(json.dumps({"error": f"bad command {line!r}"}), flush=True)
                continue
            if arg == "refuse" and server is not None:
                server.close()
                for c in list(st.conns):
                    if c.transport is not None:
                        c.transport.abort()
                await server.wait_closed()
                server = None
            elif arg != "refuse" and server is None:
                server = await listen(port)
            if st.mode == "blackhole" and arg != "blackhole":
                for c in list(st.conns):  # the held requests: as if the process restarted
                    if c.busy and c.task is None and c.transport is not None:
                        c.transport.abort()
            st.mode = arg
            st.first_ok_after_switch = None
            print(json.dumps({"mode": arg, "at": time.monotonic()}), flush=True)
        stop.set()  # stdin closed: the benchmark that started us is gone

    ctl = loop.create_task(control())
    await stop.wait()
    ctl.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ctl
    if server is not None:
        server.close()
    for c in list(st.conns):
        if c.transport is not None:
            c.transport.abort()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--sse-chunks", type=int, default=20, help="events per stream (last: [DONE])")
    p.add_argument("--sse-gap-ms", type=float, default=5.0, help="gap between events")
    p.add_argument("--sse-first-ms", type=float, default=0.0, help="wait before the first event")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))

"""A lean Python HTTP/1.1 load generator (raw asyncio), for what wrk cannot measure.

wrk gives throughput and latency of whole responses; it cannot time the first
byte of a stream or tell which upstream answered. This client can, and runs in
its own process. It reports its own CPU use (``client_cpu_util``: CPU seconds per
wall second of this process, 1.0 = one core saturated) so a run can show that
the client was not the bottleneck.

Modes (each prints one JSON line starting with ``RESULT``)::

    loadgen.py closed --url URL --concurrency 64 --duration 5 [--stream]
        keep-alive workers sending back to back: req/s, latency p50/p99, and for
        streams the time to first body byte (TTFB) and the SSE events received
    loadgen.py open --url URL [--also-url URL2 ...] --rate 50 --duration 30 --out FILE
        open loop at a fixed rate (new connections only when none is idle);
        one JSON record per request in FILE: send time (CLOCK_MONOTONIC, shared
        by every process on the machine), latency, status, x-sidecar-upstream;
        with several URLs, requests go to each in turn or to one at random
        (``--spread random``, seeded); ``target`` is its index
    loadgen.py streams --url URL --streams 1000 --ramp 2 [--abort-every 2 --abort-after 3]
        N concurrent streams, one connection each, opened over RAMP seconds;
        prints ``RAMPED`` once all have received their first event; optionally
        every K-th stream is aborted (RST) after M events

Every loop is bounded by ``--duration`` / ``--max-requests`` / ``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import struct
import sys
import time
from typing import Any, cast
from urllib.parse import urlsplit

DEFAULT_BODY = json.dumps(
    {
        "model": "gpt-4o",
        "messages": [
            {
                "role": "system",
                "content": "You are a concise assistant. Answer in one short paragraph, "
                "without lists, and keep a friendly tone.",
            },
            {
                "role": "user",
                "content": "Summarise in two sentences why a circuit breaker in front of an "
                "LLM provider helps an application stay responsive during a provider outage, "
                "and what the trade-off of a long cooldown is. Mention retries and fallbacks.",
            },
        ],
        "temperature": 0.2,
        "max_tokens": 128,
        "user": "benchmark-user-0001",
        "n": 1,
    }
).encode()


def chat_body(stream: bool) -> bytes:
    if not stream:
        return DEFAULT_BODY
    return DEFAULT_BODY[:-1] + b', "stream": true}'


class Result:
    __slots__ = ("error", "events", "first", "start", "status", "t_end", "upstream")

    def __init__(self, start: float) -> None:
        self.start = start
        self.first = 0.0
        self.t_end = 0.0
        self.status = 0
        self.upstream = ""
        self.events = 0
        self.error = ""


class Conn(asyncio.Protocol):
    """One keep-alive client connection; one request at a time."""

    def __init__(self, count_events: bool) -> None:
        self.count_events = count_events
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.fut: asyncio.Future[Result] | None = None
        self.res: Result | None = None
        self.state = 0  # 0 head, 1 content-length body, 2 chunked body
        self.remaining = 0
        self.body_parts: list[bytes] = []
        self.close_after = False
        self.on_event: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail("closed" if exc is None else type(exc).__name__)

    def _fail(self, why: str) -> None:
        if self.fut is not None and not self.fut.done() and self.res is not None:
            self.res.error = why
            self.res.t_end = time.perf_counter()
            self.fut.set_result(self.res)

    def send(self, data: bytes) -> asyncio.Future[Result]:
        assert self.transport is not None
        self.fut = asyncio.get_running_loop().create_future()
        self.res = Result(time.perf_counter())
        self.state, self.remaining, self.body_parts = 0, 0, []
        self.buf.clear()
        self.transport.write(data)
        return self.fut

    def _body(self, data: bytes | bytearray) -> None:
        res = self.res
        assert res is not None
        if data:
            if not res.first:
                res.first = time.perf_counter()
            if self.count_events:
                self.body_parts.append(bytes(data))
                if self.on_event is not None:
                    self.on_event(self, data)

    def _done(self) -> None:
        res, fut = self.res, self.fut
        assert res is not None and fut is not None
        res.t_end = time.perf_counter()
        if not res.first:
            res.first = res.t_end
        if self.count_events:
            res.events = b"".join(self.body_parts).count(b"\n\n")
        self.state = 0
        if self.close_after and self.transport is not None:
            self.transport.close()
        if not fut.done():
            fut.set_result(res)

    def data_received(self, data: bytes) -> None:
        if self.res is None:
            return
        buf = self.buf
        buf += data
        while True:
            if self.state == 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                lines = head.split(b"\r\n")
                self.res.status = int(lines[0].split(b" ", 2)[1])
                length, chunked = -1, False
                self.close_after = False
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"transfer-encoding":
                        chunked = b"chunked" in value.lower()
                    elif name == b"x-sidecar-upstream":
                        self.res.upstream = value.strip().decode()
                    elif name == b"connection":
                        self.close_after = b"close" in value.lower()
                if chunked:
                    self.state = 2
                    self.remaining = -1
                elif length >= 0:
                    self.state, self.remaining = 1, length
                    if length == 0:
                        self._done()
                        return
                else:
                    self.res.error = "no length"
                    self._done()
                    return
            if self.state == 1:
                take = buf[: self.remaining]
                del buf[: self.remaining]
                self.remaining -= len(take)
                self._body(take)
                if self.remaining == 0:
                    self._done()
                return
            # chunked: remaining -1 = expecting a size line, else data bytes (+ CRLF) left
            if self.remaining < 0:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                if size == 0:
                    if len(buf) < end + 4:
                        return  # wait for the final CRLF (no trailers expected)
                    del buf[: end + 4]
                    self._done()
                    return
                del buf[: end + 2]
                self.remaining = size + 2
            if not buf:
                return
            n = min(self.remaining, len(buf))
            piece = buf[:n]
            del buf[:n]
            self.remaining -= n
            data_part = piece if self.remaining >= 2 else piece[: len(piece) - (2 - self.remaining)]
            self._body(data_part)
            if self.remaining == 0:
                self.remaining = -1


class Target:
    def __init__(self, url: str, body: bytes, count_events: bool, headers: dict[str, str]) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("loadgen only targets loopback")
        self.port = u.port or 80
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAuthorization: Bearer sk-bench\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        ).encode() + body
        self.count_events = count_events

    async def connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: Conn(self.count_events), self.host, self.port
        )
        return conn


def _pct(vals: list[float], p: float) -> float:
    if not vals:
        return float("nan")
    vals = sorted(vals)
    k = max(0, min(len(vals) - 1, round(p / 100 * len(vals) + 0.5) - 1))
    return vals[k]


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def run_closed(a: argparse.Namespace) -> dict[str, Any]:
    tgt = Target(a.url, chat_body(a.stream), a.stream, {})
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + a.duration
    results: list[Result] = []
    errors: dict[str, int] = {}
    budget = [a.max_requests]

    async def worker() -> None:
        conn: Conn | None = None
        while loop.time() < stop_at and budget[0] > 0:
            budget[0] -= 1
            if conn is None or conn.transport is None:
                try:
                    conn = await tgt.connect()
                except OSError as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    await asyncio.sleep(0.01)
                    continue
            try:
                res = await asyncio.wait_for(conn.send(tgt.request), a.timeout)
            except TimeoutError:
                errors["timeout"] = errors.get("timeout", 0) + 1
                if conn.transport is not None:
                    conn.transport.abort()
                conn = None
                continue
            if res.error or res.status != 200:
                key = res.error or f"http_{res.status}"
                errors[key] = errors.get(key, 0) + 1
                if res.error and conn.transport is not None:
                    conn.transport.abort()
                if res.error:
                    conn = None
                continue
            results.append(res)
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    cpu0, t0 = _cpu(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    lat = [r.t_end - r.start for r in results]
    ttfb = [r.first - r.start for r in results]
    events = [r.events for r in results]
    return {
        "requests": len(results),
        "errors": errors,
        "wall_s": wall,
        "rps": len(results) / wall,
        "p50_ms": _pct(lat, 50) * 1000,
        "p99_ms": _pct(lat, 99) * 1000,
        "ttfb_p50_ms": _pct(ttfb, 50) * 1000,
        "ttfb_p99_ms": _pct(ttfb, 99) * 1000,
        "events_min": min(events) if events else 0,
        "events_total": sum(events),
        "client_cpu_s": cpu,
        "client_cpu_util": cpu / wall,
    }


async def run_open(a: argparse.Namespace) -> dict[str, Any]:
    urls = [a.url, *a.also_url]
    tgts = [Target(u, chat_body(a.stream), False, {}) for u in urls]
    loop = asyncio.get_running_loop()
    idles: list[list[Conn]] = [[] for _ in tgts]
    records: list[dict[str, Any]] = []
    tasks: set[asyncio.Task[None]] = set()
    opened = [0]

    async def one(t_send: float, which: int) -> None:
        tgt, idle = tgts[which], idles[which]
        conn = idle.pop() if idle else None
        rec: dict[str, Any] = {"t": t_send, "status": 0, "upstream": "", "error": ""}
        if len(tgts) > 1:
            rec["target"] = which
        try:
            if conn is None or conn.transport is None:
                if opened[0] >= a.max_inflight:
                    rec["error"] = "client_overflow"
                    rec["latency"] = 0.0
                    records.append(rec)
                    return
                opened[0] += 1
                conn = await tgt.connect()
            res = await asyncio.wait_for(conn.send(tgt.request), a.timeout)
            rec.update(status=res.status, upstream=res.upstream, error=res.error)
        except (OSError, TimeoutError) as exc:
            rec["error"] = type(exc).__name__ or "timeout"
            if conn is not None and conn.transport is not None:
                conn.transport.abort()
            conn = None
        rec["latency"] = time.monotonic() - t_send
        records.append(rec)
        if conn is not None and conn.transport is not None and not rec["error"]:
            idle.append(conn)
        else:
            opened[0] -= 1

    rng = random.Random(a.seed)
    t0 = time.monotonic()
    n = int(a.rate * a.duration)
    for i in range(min(n, a.max_requests)):
        at = t0 + i / a.rate
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        which = rng.randrange(len(tgts)) if a.spread == "random" else i % len(tgts)
        task = loop.create_task(one(time.monotonic(), which))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(list(tasks), timeout=a.timeout + 5)
    for idle in idles:
        for c in idle:
            if c.transport is not None:
                c.transport.close()
    return {"requests": len(records), "out": a.out, "t0": t0, "_records": records}


async def run_streams(a: argparse.Namespace) -> dict[str, Any]:
    tgt = Target(a.url, chat_body(True), True, {})
    loop = asyncio.get_running_loop()
    results: list[Result] = []
    errors: dict[str, int] = {}
    aborted = [0]
    first_seen = [0]
    ramped = asyncio.Event()

    def started() -> None:
        first_seen[0] += 1
        if first_seen[0] + sum(errors.values()) >= a.streams:
            ramped.set()

    async def one(i: int) -> None:
        try:
            conn = await tgt.connect()
        except OSError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return
        abort_this = a.abort_every > 0 and i % a.abort_every == 0
        state = {"events": 0, "first": False}

        def on_event(c: Conn, data: bytes | bytearray) -> None:
            if not state["first"]:
                state["first"] = True
                started()
            state["events"] += bytes(data).count(b"\n\n")
            if abort_this and state["events"] >= a.abort_after and c.transport is not None:
                sock = c.transport.get_extra_info("socket")
                if sock is not None:  # linger 0: close with a RST, like a killed client
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.transport.abort()

        conn.on_event = on_event
        try:
            res = await asyncio.wait_for(conn.send(tgt.request), a.timeout)
        except TimeoutError:
            errors["timeout"] = errors.get("timeout", 0) + 1
            if conn.transport is not None:
                conn.transport.abort()
            return
        finally:
            if not state["first"]:
                started()
        if abort_this and res.error:
            aborted[0] += 1
        elif res.error or res.status != 200:
            key = res.error or f"http_{res.status}"
            errors[key] = errors.get(key, 0) + 1
        else:
            results.append(res)
        if conn.transport is not None:
            conn.transport.close()

    cpu0, t0 = _cpu(), time.perf_counter()
    tasks = []
    for i in range(a.streams):
        tasks.append(loop.create_task(one(i)))
        await asyncio.sleep(a.ramp / a.streams)

    async def announce() -> None:
        await ramped.wait()
        print(f"RAMPED {time.perf_counter() - t0:.3f}", flush=True)

    ann = loop.create_task(announce())
    await asyncio.gather(*tasks)
    ann.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ann
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    ttfb = [r.first - r.start for r in results]
    total = [r.t_end - r.start for r in results]
    return {
        "completed": len(results),
        "aborted": aborted[0],
        "errors": errors,
        "events_min": min((r.events for r in results), default=0),
        "ttfb_p50_ms": _pct(ttfb, 50) * 1000,
        "ttfb_p99_ms": _pct(ttfb, 99) * 1000,
        "total_p50_s": _pct(total, 50),
        "total_p99_s": _pct(total, 99),
        "wall_s": wall,
        "client_cpu_util": cpu / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("closed", "open", "streams"):
        s = sub.add_parser(name)
        s.add_argument("--url", required=True)
        s.add_argument("--timeout", type=float, default=30.0, help="per request, seconds")
        s.add_argument("--max-requests", type=int, default=1_000_000)
        if name != "streams":
            s.add_argument("--duration", type=float, required=True)
            s.add_argument("--stream", action="store_true", help="ask for SSE")
    sub.choices["closed"].add_argument("--concurrency", type=int, default=1)
    sub.choices["open"].add_argument("--rate", type=float, required=True)
    sub.choices["open"].add_argument("--max-inflight", type=int, default=2000)
    sub.choices["open"].add_argument("--out", required=True)
    sub.choices["open"].add_argument(
        "--also-url", action="append", default=[], help="more targets (see --spread)"
    )
    sub.choices["open"].add_argument(
        "--spread",
        choices=["turn", "random"],
        default="turn",
        help="with several URLs: each in turn, or one picked at random (seeded) per request",
    )
    sub.choices["open"].add_argument("--seed", type=int, default=1)
    st = sub.choices["streams"]
    st.add_argument("--streams", type=int, required=True)
    st.add_argument("--ramp", type=float, default=2.0)
    st.add_argument("--abort-every", type=int, default=0)
    st.add_argument("--abort-after", type=int, default=3)
    a = p.parse_args()
    run = {"closed": run_closed, "open": run_open, "streams": run_streams}[a.mode]
    result = asyncio.run(run(a))
    records = result.pop("_records", None)
    if records is not None:
        with open(a.out, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())

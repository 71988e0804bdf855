"""Micro-costs of the sidecar's per-request building blocks, in-process (CPU us per call).

    .venv/bin/python benchmarks/micro.py

Each item is timed in a tight loop (best of 5 rounds) in this process, so the
numbers are the pure Python cost of one call, without the event loop's or the
kernel's share. ``pyspy_profile.py`` runs this too and puts the table into
``profile.md``: it backs the profile's suggestions with a cost per call.

The aiohttp client items send real requests to a lean upstream
(``benchmarks/upstream.py``, its own process) and count only this process's CPU
time: a ClientSession as the sidecar builds it (with its TraceConfig) against a
plain one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import benchlib as bl

ROUNDS = 5

CONFIG = """
[upstreams.primary]
base_url = "http://127.0.0.1:9"
[upstreams.primary.circuit_breaker]
failure_threshold = 3
cooldown_ms = 30000
[upstreams.backup]
base_url = "http://127.0.0.1:9"
[[routes]]
name = "anthropic"
path_prefix = "/v1/messages"
candidates = [{ upstream = "backup" }]
[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{ upstream = "primary" }, { upstream = "backup" }]
"""

CLIENT_HEADERS = {
    "Host": "127.0.0.1:8080",
    "User-Agent": "OpenAI/Python 1.40.0",
    "Accept": "application/json",
    "Content-Type": "application/json",
    "Authorization": "Bearer sk-bench",
    "Content-Length": "495",
    "x-stainless-lang": "python",
    "x-stainless-retry-count": "0",
}
UPSTREAM_HEADERS = {
    "Content-Type": "application/json",
    "Content-Length": "545",
    "Date": "Mon, 01 Jan 2024 00:00:00 GMT",
    "openai-processing-ms": "412",
    "x-request-id": "req_0123456789abcdef",
    "Connection": "keep-alive",
}


def per_call(fn: Callable[[], object], n: int) -> float:
    """Best-of-ROUNDS CPU microseconds per call of ``fn``."""
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def per_call_async(make: Callable[[], Coroutine[Any, Any, None]], n: int) -> float:
    """Best-of-ROUNDS CPU microseconds per iteration of an async body (loop cost subtracted)."""

    async def loop_body(k: int) -> float:
        t0 = time.process_time()
        for _ in range(k):
            await make()
        return time.process_time() - t0

    async def empty() -> None:
        return None

    async def run() -> float:
        best = float("inf")
        base = float("inf")
        for _ in range(ROUNDS):
            best = min(best, await loop_body(n))
            t0 = time.process_time()
            for _ in range(n):
                await empty()
            base = min(base, time.process_time() - t0)
        return max(0.0, best - base) / n * 1e6

    return asyncio.run(run())


def items() -> list[tuple[str, str, Callable[[], float]]]:
    """(name, what the sidecar does per request, measure) for each item."""
    out: list[tuple[str, str, Callable[[], float]]] = []

    def prom() -> list[tuple[str, str, Callable[[], float]]]:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        reg = CollectorRegistry()
        c = Counter("c_total", "c", ["route", "code"], registry=reg)
        h = Histogram("h_seconds", "h", ["route"], registry=reg, buckets=[0.01] * 1 + [0.1, 1.0])
        g = Gauge("g", "g", registry=reg)
        child = c.labels("chat", "200")

        def labelled() -> None:
            c.labels("chat", "200").inc()

        def observed() -> None:
            h.labels("chat").observe(0.02)

        def gauge() -> None:
            g.inc()
            g.dec()

        return [
            ("prometheus Counter.labels(a, b).inc()", "update, child looked up",
             lambda: per_call(labelled, 20000)),
            ("prometheus cached child .inc()", "update, child cached",
             lambda: per_call(child.inc, 50000)),
            ("prometheus Histogram.labels(a).observe()", "duration, child looked up",
             lambda: per_call(observed, 20000)),
            ("prometheus Gauge.inc() + .dec()", "in-flight gauge", lambda: per_call(gauge, 20000)),
        ]  # fmt: skip

    out += prom()

    async def with_timeout() -> None:
        async with asyncio.timeout(30):  # noqa: ASYNC100 (the cost of the context itself)
            pass

    async def with_timeout_reschedule() -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(30) as cm:  # noqa: ASYNC100
            cm.reschedule(loop.time() + 30)

    out.append(
        (
            "asyncio.timeout() enter + exit",
            "per deadline (request, attempt, relay)",
            lambda: per_call_async(with_timeout, 20000),
        )
    )
    out.append(
        (
            "Timeout.reschedule() (per relayed chunk)",
            "per relayed chunk (idle timeout)",
            lambda: (
                per_call_async(with_timeout_reschedule, 20000) - per_call_async(with_timeout, 20000)
            ),
        )
    )

    def sidecar_items() -> list[tuple[str, str, Callable[[], float]]]:
        from multidict import CIMultiDict

        from sidecar.clock import LoopClock
        from sidecar.config import parse_config
        from sidecar.generation import Generation
        from sidecar.headers import client_response_headers, upstream_request_headers

        config = parse_config(CONFIG, {})
        gen = Generation(config, {}, LoopClock())
        up = gen.upstreams["primary"]
        client = CIMultiDict(CLIENT_HEADERS)
        upstream = CIMultiDict(UPSTREAM_HEADERS)
        route = gen.routes.resolve("/v1/chat/completions", {}, b"{}")
        assert route is not None
        target = route.candidates[0].target

        def breaker_cycle() -> None:
            from sidecar.breakers.machine import Verdict

            permit = gen.breakers.admit(target)
            assert permit is not None
            gen.breakers.record(permit, Verdict.SUCCESS)

        async def _init() -> None:
            return None

        asyncio.run(_init())  # LoopClock needs no running loop for now()? keep it honest
        res: list[tuple[str, str, Callable[[], float]]] = [
            (
                "sidecar.headers.upstream_request_headers (8 headers)",
                "per request",
                lambda: per_call(
                    lambda: upstream_request_headers(
                        client, extra={}, auth_header="authorization", api_key=None
                    ),
                    20000,
                ),
            ),
            (
                "sidecar.headers.client_response_headers (6 headers)",
                "per request",
                lambda: per_call(
                    lambda: client_response_headers(upstream, upstream="primary", attempts=1),
                    20000,
                ),
            ),
            (
                "Upstream.url(path) (yarl URL build)",
                "per attempt",
                lambda: per_call(lambda: up.url("/v1/chat/completions"), 20000),
            ),
            (
                "RouteTable.resolve",
                "per request",
                lambda: per_call(
                    lambda: gen.routes.resolve("/v1/chat/completions", {}, b"{}"), 20000
                ),
            ),
            (
                "breaker admit + record(success)",
                "per candidate call",
                lambda: per_call_loop(breaker_cycle, 20000),
            ),
        ]
        return res

    try:
        out += sidecar_items()
    except Exception as exc:  # the product code moves; report, do not fail
        out.append((f"sidecar internals: {type(exc).__name__}: {exc}", "-", lambda: float("nan")))

    def retry_objects() -> float:
        import aiohttp
        from aiohttp_retry import ExponentialRetry, RetryClient

        async def run() -> float:
            session = aiohttp.ClientSession()
            try:

                def make() -> None:
                    opts = ExponentialRetry(
                        attempts=3,
                        start_timeout=0.25,
                        max_timeout=2.0,
                        factor=2.0,
                        statuses={408, 429, 500, 502, 503, 504, 529},
                        exceptions={ValueError},
                        retry_all_server_errors=False,
                    )
                    RetryClient(client_session=session, retry_options=opts)

                return per_call(make, 20000)
            finally:
                await session.close()

        return asyncio.run(run())

    out.append(("aiohttp_retry ExponentialRetry + RetryClient built", "per build", retry_objects))
    out.extend(access_log_items())
    return out


def access_log_items() -> list[tuple[str, str, Callable[[], float]]]:
    """The access log's line (issue #14): the whole emit to a file, and its JSON alone."""
    import json
    import logging
    import os
    from types import SimpleNamespace
    from typing import cast

    from aiohttp import web

    from sidecar import access_log
    from sidecar.exchange import Exchange
    from sidecar.logs import JsonFormatter
    from sidecar.testing import FakeClock

    clock = FakeClock()
    ex = Exchange(clock, cast("asyncio.Task[object]", None), clock.now())
    ex.route, ex.upstream, ex.attempts, ex.status, ex.first_byte_s = "chat", "primary", 1, 200, 0.0
    request = cast(web.BaseRequest, SimpleNamespace(method="POST", path="/v1/chat/completions"))
    formatter = JsonFormatter()
    record = logging.LogRecord("sidecar.access", logging.INFO, "", 0, "request", (), None)
    record.fields = {"route": "chat", "method": "POST", "path": "/v1/chat/completions",
                     "status": 200, "upstream": "primary", "attempts": 1, "fallbacks": 0,
                     "duration_ms": 12.345, "first_byte_ms": 3.21, "outcome": "ok",
                     "error": None}  # fmt: skip

    def emit() -> float:
        logger = access_log.ACCESS_LOGGER
        handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115
        handler.setFormatter(formatter)
        logger.addHandler(handler)
        logger.propagate = False
        try:
            return per_call(lambda: access_log.emit(ex, request), 20000)
        finally:
            logger.propagate = True
            logger.removeHandler(handler)
            handler.stream.close()

    def stdlib_json() -> None:
        json.dumps({"ts": "2026-01-01T00:00:00.000+00:00", **record.fields}, default=str)

    return [
        ("access log line: emit() to a file", "per request, access_log on", emit),
        ("access log line: JsonFormatter.format (orjson)", "its JSON alone",
         lambda: per_call(lambda: formatter.format(record), 50000)),
        ("access log line: json.dumps instead", "what the stdlib encoder would cost",
         lambda: per_call(stdlib_json, 50000)),
    ]  # fmt: skip


def per_call_loop(fn: Callable[[], object], n: int) -> float:
    """per_call inside a running event loop (for code that reads the loop's clock)."""

    async def run() -> float:
        return per_call(fn, n)

    return asyncio.run(run())


def client_costs(n: int = 3000) -> list[tuple[str, str, float]]:
    """CPU us per request of this process, aiohttp client against the lean upstream."""
    import aiohttp
    from loadgen import DEFAULT_BODY

    async def mark(*_: object) -> None:
        return None

    async def run(port: int, trace: bool, concurrency: int) -> float:
        kwargs: dict[str, Any] = {}
        if trace:
            tc = aiohttp.TraceConfig()
            tc.on_connection_reuseconn.append(mark)
            kwargs["trace_configs"] = [tc]
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
            skip_auto_headers=frozenset({"Accept", "Accept-Encoding", "User-Agent"}),
            **kwargs,
        )
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
        per = n // concurrency

        async def worker() -> None:
            for _ in range(per):
                async with session.request(
                    "POST", url, data=DEFAULT_BODY, headers=headers, allow_redirects=False
                ) as r:
                    await r.read()

        try:
            await worker()  # warm the pool
            best = float("inf")
            for _ in range(3):
                t0 = time.process_time()
                await asyncio.gather(*(worker() for _ in range(concurrency)))
                best = min(best, time.process_time() - t0)
            return best / (per * concurrency) * 1e6
        finally:
            await session.close()

    rows = []
    with bl.workdir("bench-micro-") as wd, bl.Procs(wd) as procs:
        _, port = bl.start_upstream(procs, "upstream")
        for trace in (False, True):
            cost = asyncio.run(run(port, trace, 16))
            what = "with the sidecar's TraceConfig" if trace else "plain session"
            rows.append((f"aiohttp client request + read ({what}), c=16", "per attempt", cost))
    return rows


def measure_all() -> list[list[Any]]:
    rows: list[list[Any]] = []
    for name, uses, fn in items():
        try:
            rows.append([name, uses, fn()])
        except Exception as exc:
            rows.append([f"{name} ({type(exc).__name__}: {exc})", uses, float("nan")])
    try:
        rows += [list(r) for r in client_costs()]
    except Exception as exc:
        rows.append([f"aiohttp client ({type(exc).__name__}: {exc})", "-", float("nan")])
    return rows


def main() -> int:
    # No options; --help says what the script does instead of running it.
    argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0]).parse_args()
    rows = measure_all()
    print(bl.md_table(["item", "paid", "CPU us per call"], rows))
    bl.write_json("micro.json", {"command": bl.command_line(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bounding the load that failures add (#24): the retry budget and the client's deadline.

    .venv/bin/python benchmarks/load_bounds.py [--quick] [--scenarios budget,deadline]
                                              [--before DIR] [--out STEM]

Two scenarios, each with its own sidecar(s) (``sidecar serve``) in front of fake
upstreams on loopback:

1. ``budget``: a primary that answers 503 to a seeded ``--fail-share`` (30 %) of the
   requests it reads (each answer, 503 or 200, after ``--latency-ms``), and a healthy
   fallback; a closed loop of ``--concurrency`` (32) aiohttp clients for
   ``--budget-s`` (20) seconds, with the retry budget off (``budget_percent = 100``,
   ``min_retry_concurrency = 100000``: at most one retry per call is in flight, so
   retries in flight never reach the requests in flight) and on (the defaults, 20 %
   and 3). Per client request: upstream attempts (read by the fakes), the primary's
   share of them, success rate, latency; the sidecar's
   ``sidecar_retries_skipped_total{reason="budget"}`` and
   ``sidecar_fallbacks_total{reason="budget"}``. No breaker (the budget alone).
2. ``deadline``: the official ``openai`` SDK (``AsyncOpenAI``, its default
   ``max_retries`` 2, ``timeout=2``) against a primary that stalls (never answers
   within ``--stall-s``) on a seeded ``--stall-share`` (50 %) of the requests it reads
   and answers the rest after ``--latency-ms``; ``--sdk-callers`` (16) concurrent SDK
   callers for ``--deadline-s`` (20) seconds (then the calls in flight finish), through
   the sidecar of ``--before DIR`` (a checkout that predates the client's deadline,
   e.g. ``git worktree add /tmp/lb-before 1cf42c4``; skipped when not given) and
   through this checkout's ("after"). Per SDK call: ``APITimeoutError`` count (the
   SDK gave up), other errors by status, HTTP requests the SDK sent (an ``httpx``
   event hook), upstream attempts (read by the fake), time to answer p50/p99; and the
   stalled upstream calls the sidecar still held when every SDK call had ended.
   Defaults otherwise (``first_byte_timeout_ms`` 60000, no breaker).

The fakes run in one child process (``load_bounds.py fake SPEC``: an aiohttp server
per member, each on its own port from binding 0, controlled through stdin); the
clients in this process. Writes ``benchmarks/results/load-bounds.{md,png,json}``
(``--quick``: ``load-bounds-quick.*``; ``--out STEM``: ``STEM.*``); ``--report-only``
rewrites the ``.md``/``.png`` from the ``.json`` without measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl
import member_fakes as mf

PATH = "/v1/chat/completions"
SCENARIOS = ["budget", "deadline"]

COMPLETION = json.dumps(
    {
        "id": "chatcmpl-lb",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "A short answer from the fake."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28},
    },
    separators=(",", ":"),
).encode()
OVERLOADED = b'{"error":{"message":"The server is overloaded.","type":"server_error"}}'

# -- the fake upstreams (a child process: ``load_bounds.py fake SPEC``) -----------------------


class FakeMember:
    """One fake upstream. ``fail`` share of the requests it reads get a 503, ``stall``
    share get nothing until ``stall_s`` has passed or ``release`` (then a 503); the
    rest a chat completion. Both draws come from ``random.Random(seed)``; every answer
    comes after ``latency_s``."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.seed = seed
        self.rand = random.Random(seed)
        self.fail = 0.0
        self.stall = 0.0
        self.stall_s = 30.0
        self.latency_s = 0.1
        self.counts = {"requests": 0, "ok": 0, "503": 0, "stalled": 0}
        self.stalls_open = 0
        self.released = asyncio.Event()

    def set(self, **kv: str) -> None:
        for k in ("fail", "stall", "stall_s", "latency_s"):
            if k in kv:
                setattr(self, k, float(kv[k]))

    def reset(self) -> None:
        self.rand = random.Random(self.seed)
        self.counts = dict.fromkeys(self.counts, 0)
        self.released = asyncio.Event()


async def fake_main(spec: list[dict[str, Any]]) -> None:
    from aiohttp import web

    member_key = web.AppKey("member", FakeMember)

    async def handle(request: web.Request) -> web.Response:
        m = request.app[member_key]
        await request.read()
        m.counts["requests"] += 1
        draw = m.rand.random()
        if draw < m.stall:
            m.counts["stalled"] += 1
            m.stalls_open += 1
            try:
                released = m.released
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(released.wait(), m.stall_s)
            finally:
                m.stalls_open -= 1
            return web.Response(status=503, body=OVERLOADED, content_type="application/json")
        await asyncio.sleep(m.latency_s)
        if draw < m.stall + m.fail:
            m.counts["503"] += 1
            return web.Response(status=503, body=OVERLOADED, content_type="application/json")
        m.counts["ok"] += 1
        return web.Response(body=COMPLETION, content_type="application/json")

    def release(members: dict[str, FakeMember]) -> None:
        for m in members.values():
            m.released.set()

    # handler_cancellation: a stalled handler ends when the sidecar closes its
    # connection, so "stalls open" counts the upstream calls the sidecar still holds.
    await mf.serve_members(
        [FakeMember(x["name"], x["seed"]) for x in spec],
        handle,
        member_key,
        stats=lambda m: {**m.counts, "stalls_open": m.stalls_open},
        reset=FakeMember.reset,
        commands={"release": release},
        handler_cancellation=True,
    )


def fake_counts(proc: bl.Proc) -> dict[str, dict[str, int]]:
    members: dict[str, dict[str, int]] = mf.fake_cmd(proc, "stats")["members"]
    return members


# -- sidecars ---------------------------------------------------------------------------------


def sidecar(
    procs: bl.Procs, wd: Path, name: str, body: str, checkout: Path | None = None
) -> tuple[bl.Proc, int, int]:
    """A sidecar on free loopback ports: this checkout's ``sidecar`` script, or with
    ``checkout`` that checkout's code (``python -m sidecar`` with its root as cwd and
    PYTHONPATH, as ``instructions.py --ref`` runs it)."""
    listen, admin = bl.free_port(), bl.free_port()
    config = bl.write_sidecar_config(wd / f"{name}.toml", body, listen=listen, admin=admin)
    if checkout is None:
        return bl.start_sidecar(procs, name, config), listen, admin
    cmd = [bl.PY, "-m", "sidecar", "serve", "--config", str(config)]
    proc = procs.start(name, cmd, env={"PYTHONPATH": str(checkout)}, cwd=checkout)
    deadline = time.monotonic() + 20
    while True:
        if not proc.alive():
            raise RuntimeError(f"{name} exited early; see {proc.log}")
        try:
            if bl.http_get(admin, "/readyz")[0] == 200:
                return proc, listen, admin
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready; see {proc.log}")
        time.sleep(0.05)


def metrics(admin: int, name: str, label: str) -> dict[str, float]:
    """A metric's samples summed by one label's value."""
    _, body = bl.http_get(admin, "/metrics")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def cpu_of(pids: tuple[int, ...]) -> float:
    """CPU seconds used so far by the processes ``pids``."""
    return sum(bl.cpu_seconds(p) for p in pids)


def lat_stats(lat: list[float]) -> dict[str, float]:
    s = sorted(lat)
    return {
        "p50_ms": bl.percentile(s, 50) * 1000,
        "p90_ms": bl.percentile(s, 90) * 1000,
        "p99_ms": bl.percentile(s, 99) * 1000,
        "max_ms": (s[-1] if s else float("nan")) * 1000,
    }


BODY = json.dumps(
    {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
).encode()
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}

# -- 1. budget: a primary failing 30 % of calls -----------------------------------------------

BUDGET_TOML = """request_timeout_ms = 30000

[upstreams.primary]
base_url = "http://127.0.0.1:{primary}"

[upstreams.primary.retry]
budget_percent = {percent}
min_retry_concurrency = {minimum}

[upstreams.fallback]
base_url = "http://127.0.0.1:{fallback}"

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary" }}, {{ upstream = "fallback" }}]
"""
BUDGETS = {"off": (100, 100000), "on": (20, 3)}


async def closed_loop(url: str, conc: int, duration: float) -> list[dict[str, Any]]:
    import aiohttp

    recs: list[dict[str, Any]] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        stop = time.monotonic() + duration

        async def worker() -> None:
            while time.monotonic() < stop:
                t0 = time.monotonic()
                rec: dict[str, Any] = {"t": t0, "status": 0, "up": "", "err": ""}
                try:
                    async with s.post(url, data=BODY, headers=HEADERS) as r:
                        await r.read()
                        rec["status"] = r.status
                        rec["up"] = r.headers.get("x-sidecar-upstream", "")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    rec["err"] = type(exc).__name__ or "error"
                rec["lat"] = time.monotonic() - t0
                recs.append(rec)

        await asyncio.gather(*(worker() for _ in range(conc)))
    return recs


def budget(procs: bl.Procs, wd: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = [{"name": "primary", "seed": args.seed}, {"name": "fallback", "seed": args.seed + 1}]
    fake, ports = mf.start_fake(procs, __file__, "fake-budget", spec)
    lat_s = args.latency_ms / 1000
    mf.fake_cmd(fake, f"set primary fail={args.fail_share} latency_s={lat_s}")
    mf.fake_cmd(fake, f"set fallback latency_s={lat_s}")
    out = []
    for label, (percent, minimum) in BUDGETS.items():
        bl.progress(
            f"budget {label}: {args.budget_s:g} s at c={args.concurrency}, "
            f"primary failing {args.fail_share:.0%}"
        )
        mf.fake_cmd(fake, "reset")
        toml = BUDGET_TOML.format(primary=ports["primary"], fallback=ports["fallback"],
                                  percent=percent, minimum=minimum)  # fmt: skip
        sc, listen, admin = sidecar(procs, wd, f"budget-{label}", toml)
        own = bl.ForeignCpu(functools.partial(cpu_of, (sc.pid, fake.pid)))
        url = f"http://127.0.0.1:{listen}{PATH}"
        recs = asyncio.run(closed_loop(url, args.concurrency, args.budget_s))
        foreign = own.cores()
        counts = fake_counts(fake)
        skipped = metrics(admin, "sidecar_retries_skipped_total", "reason")
        fallbacks = metrics(admin, "sidecar_fallbacks_total", "reason")
        attempts = metrics(admin, "sidecar_upstream_attempts_total", "upstream")
        procs.stop(sc)
        n = len(recs)
        ok = [r for r in recs if r["status"] == 200 and not r["err"]]
        prim, fb = counts["primary"], counts["fallback"]
        r = {
            "budget": label,
            "budget_percent": percent,
            "min_retry_concurrency": minimum,
            "requests": n,
            "req_per_s": n / args.budget_s,
            "success": len(ok) / max(n, 1),
            "statuses": {
                str(s): sum(1 for x in recs if x["status"] == s)
                for s in sorted({x["status"] for x in recs})
            },
            "answered_by": {u: sum(1 for x in ok if x["up"] == u) for u in ("primary", "fallback")},
            "primary_reads": prim["requests"],
            "primary_503": prim["503"],
            "fallback_reads": fb["requests"],
            "attempts_per_request": (prim["requests"] + fb["requests"]) / max(n, 1),
            "primary_attempts_per_request": prim["requests"] / max(n, 1),
            "retries_per_request": max(0, prim["requests"] - n) / max(n, 1),
            "skipped_budget": skipped.get("budget", 0.0),
            "fallbacks": fallbacks,
            "sidecar_attempts": attempts,
            "foreign_cores": foreign,
            **lat_stats([x["lat"] for x in recs]),
        }
        bl.progress(
            f"  {n} requests ({r['req_per_s']:.0f}/s), success {r['success']:.2%}, "
            f"attempts/request {r['attempts_per_request']:.3f} (primary "
            f"{r['primary_attempts_per_request']:.3f}), skipped by budget "
            f"{r['skipped_budget']:.0f}, p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms"
        )
        out.append(r)
    procs.stop(fake)
    return out


# -- 2. deadline: the openai SDK at timeout=2 against a stalling primary ----------------------

DEADLINE_TOML = """[upstreams.primary]
base_url = "http://127.0.0.1:{primary}"

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary" }}]
"""


async def sdk_loop(
    base_url: str, callers: int, duration: float, sdk_timeout: float
) -> tuple[list[dict[str, Any]], int]:
    """``callers`` concurrent SDK callers, each calling again as soon as its call ended
    until ``duration`` has passed; returns the calls and the HTTP requests the SDK sent."""
    import openai

    sent = 0

    async def on_request(request: Any) -> None:
        nonlocal sent
        sent += 1

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request]})
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key="sk-bench", timeout=sdk_timeout, http_client=http
    )
    recs: list[dict[str, Any]] = []
    stop = time.monotonic() + duration

    async def caller() -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            rec: dict[str, Any] = {"t": t0, "result": "ok"}
            try:
                await client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "Hello"}], max_tokens=16
                )
            except openai.APITimeoutError:
                rec["result"] = "APITimeoutError"
            except openai.APIStatusError as exc:
                rec["result"] = f"http_{exc.status_code}"
            except openai.APIConnectionError as exc:
                rec["result"] = type(exc).__name__
            rec["lat"] = time.monotonic() - t0
            recs.append(rec)

    async with client:
        await asyncio.gather(*(caller() for _ in range(callers)))
    return recs, sent


def deadline(procs: bl.Procs, wd: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    import openai

    spec = [{"name": "primary", "seed": args.seed + 2}]
    fake, ports = mf.start_fake(procs, __file__, "fake-deadline", spec)
    mf.fake_cmd(fake, f"set primary stall={args.stall_share} stall_s={args.stall_s} "
                   f"latency_s={args.latency_ms / 1000}")  # fmt: skip
    runs: list[tuple[str, Path | None]] = []
    if args.before:
        runs.append(("before", Path(args.before).resolve()))
    runs.append(("after", None))
    out = []
    for label, checkout in runs:
        code = bl.git_state(checkout) if checkout else bl.git_state()
        bl.progress(f"deadline {label} ({code}): {args.sdk_callers} SDK callers, "
                    f"{args.deadline_s:g} s, primary stalling {args.stall_share:.0%}")  # fmt: skip
        mf.fake_cmd(fake, "reset")
        toml = DEADLINE_TOML.format(primary=ports["primary"])
        sc, listen, _ = sidecar(procs, wd, f"deadline-{label}", toml, checkout)
        started = time.monotonic()
        recs, sent = asyncio.run(
            sdk_loop(f"http://127.0.0.1:{listen}/v1", args.sdk_callers, args.deadline_s,
                     args.sdk_timeout)
        )  # fmt: skip
        took = time.monotonic() - started
        counts = fake_counts(fake)["primary"]
        mf.fake_cmd(fake, "release")
        procs.stop(sc)
        n = len(recs)
        results: dict[str, int] = {}
        for x in recs:
            results[x["result"]] = results.get(x["result"], 0) + 1
        r = {
            "run": label,
            "code": code,
            "calls": n,
            "took_s": took,
            "results": results,
            "success": results.get("ok", 0) / max(n, 1),
            "sdk_timeouts": results.get("APITimeoutError", 0),
            "sdk_requests": sent,
            "sdk_requests_per_call": sent / max(n, 1),
            "upstream_attempts": counts["requests"],
            "upstream_attempts_per_call": counts["requests"] / max(n, 1),
            "upstream_stalled": counts["stalled"],
            "stalls_held_at_end": counts["stalls_open"],
            **lat_stats([x["lat"] for x in recs]),
            "openai": openai.__version__,
            "lat_by_result": {
                k: sorted(round(x["lat"], 4) for x in recs if x["result"] == k) for k in results
            },
        }
        bl.progress(
            f"  {n} SDK calls: {results}; SDK requests/call {r['sdk_requests_per_call']:.2f}, "
            f"upstream attempts/call {r['upstream_attempts_per_call']:.2f}, "
            f"p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms, "
            f"stalls still held {r['stalls_held_at_end']}"
        )
        out.append(r)
    procs.stop(fake)
    return out


# -- report -----------------------------------------------------------------------------------


def budget_md(args: argparse.Namespace, res: list[dict[str, Any]]) -> list[str]:
    if not res:
        return []
    rows = [
        [
            f"{r['budget']} ({r['budget_percent']:g} %, {r['min_retry_concurrency']})",
            r["requests"],
            f"{r['success']:.2%}",
            f"{r['attempts_per_request']:.3f}",
            f"{r['primary_attempts_per_request']:.3f}",
            f"{r['retries_per_request']:.3f}",
            r["answered_by"]["fallback"],
            int(r["skipped_budget"]),
            r["p50_ms"],
            r["p99_ms"],
            f"{r['foreign_cores']:.2f}",
        ]
        for r in res
    ]
    head = ["budget (percent, min)", "client requests", "success", "upstream attempts / request",
            "primary attempts / request", "retries / request", "answered by fallback",
            "retries skipped (budget)", "p50 ms", "p99 ms", "other load (cores)"]  # fmt: skip
    by = {r["budget"]: r for r in res}
    reading = []
    if "off" in by and "on" in by:
        off, on = by["off"], by["on"]
        reading = [
            f"**Reading.** With the budget off, the primary failing {args.fail_share:.0%} of "
            f"its calls received {off['primary_attempts_per_request']:.3f} attempts per "
            f"client request (1 + 0.3 + 0.09 = 1.39 expected from independent draws); "
            f"with Envoy's default budget {on['primary_attempts_per_request']:.3f}: "
            f"{off['retries_per_request']:.3f} retries per request down to "
            f"{on['retries_per_request']:.3f} "
            f"({1 - on['retries_per_request'] / max(off['retries_per_request'], 1e-9):.0%} "
            f"fewer), the refused retries going to the fallback instead "
            f"({on['answered_by']['fallback']:,} answers from it against "
            f"{off['answered_by']['fallback']:,}). Success stays "
            f"{on['success']:.2%} (off: {off['success']:.2%}): the fallback is healthy. "
            f"Latency: p50 {off['p50_ms']:.0f} -> {on['p50_ms']:.0f} ms, p99 "
            f"{off['p99_ms']:.0f} -> {on['p99_ms']:.0f} ms (a refused retry falls back "
            "at once instead of waiting its backoff).",
            "",
        ]
    return [
        "## 1. A primary failing 30 % of calls: retry budget off and on",
        "",
        f"Closed loop of {args.concurrency} aiohttp clients for {args.budget_s:g} s per "
        f"run; the primary answers 503 to a seeded {args.fail_share:.0%} of the requests "
        f"it reads (a retry draws again), every answer of both fakes after "
        f"{args.latency_ms:g} ms; retries: the defaults (2, backoff 250 ms doubling, full "
        "jitter); no breaker. *Upstream attempts* are the requests the fakes read; "
        "*retries* = primary attempts - client requests.",
        "",
        bl.md_table(head, rows),
        "",
        *reading,
    ]


def deadline_md(args: argparse.Namespace, res: list[dict[str, Any]]) -> list[str]:
    if not res:
        return []
    rows = []
    for r in res:
        other = {k: v for k, v in r["results"].items() if k not in ("ok", "APITimeoutError")}
        rows.append(
            [
                f"{r['run']} (`{r['code']}`)",
                r["calls"],
                f"{r['success']:.1%}",
                r["sdk_timeouts"],
                ", ".join(f"{k}: {v}" for k, v in sorted(other.items())) or "-",
                f"{r['sdk_requests_per_call']:.2f}",
                f"{r['upstream_attempts_per_call']:.2f}",
                r["p50_ms"],
                r["p99_ms"],
                r["max_ms"],
                r["stalls_held_at_end"],
            ]
        )
    head = ["sidecar", "SDK calls", "success", "APITimeoutError", "other errors",
            "SDK HTTP requests / call", "upstream attempts / call", "p50 ms", "p99 ms",
            "max ms", "stalled calls still held"]  # fmt: skip
    by = {r["run"]: r for r in res}
    reading = []
    if "before" in by and "after" in by:
        b, a = by["before"], by["after"]
        reading = [
            f"**Reading.** Before, the sidecar waited on a stalled primary past the SDK's "
            f"{args.sdk_timeout:g} s, the SDK timed out and retried (its default 2 retries): "
            f"{b['sdk_requests_per_call']:.2f} HTTP requests and "
            f"{b['upstream_attempts_per_call']:.2f} upstream attempts per SDK call, "
            f"{b['sdk_timeouts']} calls ending in `APITimeoutError`, p99 "
            f"{b['p99_ms']:,.0f} ms. After, the sidecar answers its 504 with "
            f"`x-should-retry: false` 1.9 s after the request came: "
            f"{a['sdk_requests_per_call']:.2f} HTTP requests and "
            f"{a['upstream_attempts_per_call']:.2f} upstream attempts per call, "
            f"{a['sdk_timeouts']} `APITimeoutError`, p99 {a['p99_ms']:,.0f} ms. The price: "
            f"with no fallback configured, a stalled first try is now the call's answer "
            f"(success {b['success']:.1%} before, {a['success']:.1%} after): before, the "
            "SDK's retries got another draw at the stalling primary, each one more "
            "request for it to read (the abandoned attempt itself was closed when the "
            "SDK hung up: no stalled call was still held at the end). "
            f"The callers run a closed loop (a call that ends sooner is followed sooner: "
            f"{a['calls']} calls after against {b['calls']} before), so the comparison is "
            "per call, not per second.",
            "",
        ]
    return [
        "## 2. The client's deadline: the openai SDK at `timeout=2` against a stalling primary",
        "",
        f"{args.sdk_callers} concurrent callers of `AsyncOpenAI(timeout={args.sdk_timeout:g})` "
        f"(openai {res[-1]['openai']}, default `max_retries` 2) for {args.deadline_s:g} s "
        "(then the calls in flight finish); the primary stalls on a seeded "
        f"{args.stall_share:.0%} of the requests it reads (no answer for "
        f"{args.stall_s:g} s) and answers the rest after {args.latency_ms:g} ms. One "
        "route, one candidate, no breaker, the sidecar's default timeouts "
        "(`first_byte_timeout_ms` 60000). *Before*: a checkout without the client's "
        "deadline; *after*: this one. *Stalled calls still held*: upstream requests of "
        "the run still open at the fake when every SDK call had ended.",
        "",
        bl.md_table(head, rows),
        "",
        *reading,
    ]


def report(
    args: argparse.Namespace, info: dict[str, str], results: dict[str, Any], command: str
) -> str:
    lines = [
        "# Bounding the load that failures add (#24): retry budget, the client's deadline",
        "",
        f"Command: `{command}`",
        "",
        bl.machine_md(info),
        "",
        f"Took {results['took_min']:.1f} min. Every process on 127.0.0.1; the fakes are "
        "aiohttp servers in one child process (`load_bounds.py fake`), the clients run "
        "in the benchmark's own process.",
        "",
        *budget_md(args, results.get("budget", [])),
        *deadline_md(args, results.get("deadline", [])),
        "![load-bounds](load-bounds.png)",
        "",
        "## Sidecar configs",
        "",
        "Scenario 1 (budget on; off: `budget_percent = 100`, `min_retry_concurrency = "
        "100000`), scenario 2 (both checkouts):",
        "",
        *bl.sidecar_config_md(BUDGET_TOML.format(primary="P", fallback="F", percent=20, minimum=3)),
        "",
        *bl.sidecar_config_md(DEADLINE_TOML.format(primary="P")),
    ]
    return "\n".join(lines) + "\n"


def chart(path: Path, args: argparse.Namespace, results: dict[str, Any]) -> bool:
    plt = bl.matplotlib_pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    bu = results.get("budget") or []
    ax = axes[0]
    xs = range(len(bu))
    first = [1.0 for _ in bu]
    retries = [r["retries_per_request"] for r in bu]
    fb = [r["fallback_reads"] / max(r["requests"], 1) for r in bu]
    ax.bar(xs, first, 0.5, label="primary: first attempts", color="tab:blue")
    ax.bar(xs, retries, 0.5, bottom=first, label="primary: retries", color="tab:red")
    ax.bar(xs, fb, 0.5, bottom=[a + b for a, b in zip(first, retries, strict=True)],
           label="fallback", color="tab:green")  # fmt: skip
    for x, r in zip(xs, bu, strict=True):
        ax.text(x, r["attempts_per_request"] + 0.02, f"{r['attempts_per_request']:.3f}\n"
                f"success {r['success']:.1%}", ha="center", fontsize=8)  # fmt: skip
    ax.set_xticks(list(xs), [f"budget {r['budget']}" for r in bu])
    ax.set_ylim(0, 2.0)
    ax.set_ylabel("upstream attempts per client request")
    ax.set_title(f"1. primary failing {args.fail_share:.0%}, c={args.concurrency}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    if bu:
        ax.legend(fontsize=8, loc="upper center", ncol=3)
    de = results.get("deadline") or []
    ax = axes[1]
    xs = range(len(de))
    ax.bar([x - 0.2 for x in xs], [r["sdk_requests_per_call"] for r in de], 0.4,
           label="SDK HTTP requests / call")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [r["upstream_attempts_per_call"] for r in de], 0.4,
           label="upstream attempts / call")  # fmt: skip
    for x, r in zip(xs, de, strict=True):
        ax.text(x, max(r["sdk_requests_per_call"], r["upstream_attempts_per_call"]) + 0.05,
                f"APITimeoutError {r['sdk_timeouts']}/{r['calls']}", ha="center",
                fontsize=8)  # fmt: skip
    ax.set_xticks(list(xs), [r["run"] for r in de])
    ax.set_ylim(0, 2.5)
    ax.set_title(f"2. openai SDK timeout={args.sdk_timeout:g}, primary stalling "
                 f"{args.stall_share:.0%}", fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3, axis="y")
    if de:
        ax.legend(fontsize=8)
    ax = axes[2]
    for r in de:
        lat = sorted(v for vals in r["lat_by_result"].values() for v in vals)
        if lat:
            ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=r["run"])
    ax.axvline(args.sdk_timeout, color="k", ls=":", lw=1)
    ax.set_xlabel("time to answer per SDK call, s (dotted: the SDK's timeout)")
    ax.set_ylabel("share of calls (CDF)")
    ax.set_title("2. time to answer (any result)", fontsize=9)
    ax.grid(alpha=0.3)
    if de:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "fake":
        asyncio.run(fake_main(json.loads(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="5 s runs")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--out", default=None, help="results file stem in benchmarks/results")
    p.add_argument("--seed", type=int, default=24)
    p.add_argument("--latency-ms", type=float, default=100)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--fail-share", type=float, default=0.3)
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--before", default=None, help="checkout root predating the deadline")
    p.add_argument("--sdk-callers", type=int, default=16)
    p.add_argument("--sdk-timeout", type=float, default=2.0)
    p.add_argument("--stall-share", type=float, default=0.5)
    p.add_argument("--stall-s", type=float, default=30.0)
    p.add_argument("--deadline-s", type=float, default=None)
    p.add_argument("--report-only", action="store_true", help="rewrite STEM.md/png from STEM.json")
    args = p.parse_args()
    stem = args.out or ("load-bounds-quick" if args.quick else "load-bounds")
    if args.report_only:
        print(write_outputs(stem))
        return 0
    args.budget_s = args.budget_s or (5.0 if args.quick else 20.0)
    args.deadline_s = args.deadline_s or (5.0 if args.quick else 20.0)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if not scenarios or set(scenarios) - set(SCENARIOS):
        p.error(f"--scenarios: pick from {', '.join(SCENARIOS)}")
    results = bl.run_scenarios(
        "load-bounds", stem, args, {"budget": budget, "deadline": deadline}, scenarios
    )
    print(write_outputs(stem))
    print(f"took {results['took_min']:.1f} min")
    return 0


def write_outputs(stem: str) -> str:
    """``STEM.md`` and ``STEM.png`` from ``STEM.json`` (a run's, or an earlier one's)."""
    return bl.scenario_outputs(stem, "load-bounds.png", report, chart)


if __name__ == "__main__":
    sys.exit(main())

"""Equal candidates (#22): how a tier shares load, keeps sessions, ramps and what it costs.

    .venv/bin/python benchmarks/balance.py [--quick] [--scenarios speed,cache,ramp,cost]
                                          [--out STEM]

Four scenarios, each with its own sidecar(s) (``sidecar serve``) in front of fake
upstreams on loopback:

1. ``speed``: two keys of one tier, one with three times the other's time to first
   token (``--fast-ms`` 100, ``--slow-ms`` 300); a closed loop of ``--concurrency`` 8
   streaming clients for ``--speed-s`` seconds per ``balance`` (``least_loaded``,
   ``ordered``, ``weighted``, equal weights): the share of requests each key got per
   second, and p50/p99 time to first token.
2. ``cache``: three members with a prompt cache per conversation: a member answers
   ``--cached-ms`` (not ``--uncached-ms``) and reports
   ``usage.prompt_tokens_details.cached_tokens`` for a conversation it has answered
   before (keyed by the first user message). 50 sessions x 10 turns (``--think-s``
   between turns), without and with ``affinity_header = "x-session-id"``, each also
   through an outage of one member (503 from ``--cache-outage`` seconds for as long):
   the cache hit ratio over turns 2-10, before, during and after the outage, and the
   sessions that changed member.
3. ``ramp``: a primary and a backup (ordered route); open-loop ``--ramp-rate``
   requests/s. The primary serves everything, then answers 503 for ``--ramp-outage``
   seconds; it comes back with a hidden capacity of ``--capacity`` requests/s (a
   token bucket; 429 above it). From the breaker's close (its probe), for
   ``--ramp-window`` seconds: the primary's 429s, its 200s, the backup's, the client's
   failed requests and the breaker's reopenings, with ``ramp_ms`` 0 and
   ``--ramp-ms`` (20000).
4. ``cost``: CPU per JSON request of the sidecar (``/proc/<pid>/stat`` utime + stime,
   as ``overhead.py``) with a two-member ``least_loaded`` tier against an ordered
   route of the same two candidates, and the bare relay, the same lean upstream
   (``upstream.py``) behind all; wrk at c=32, ``--reps`` interleaved repetitions (the
   order rotated), the ratio of the medians.

The fake upstreams of 1-3 run in one child process (``balance.py fake``: an aiohttp
server per member, each on its own port from binding 0, controlled through stdin).
The clients of 1-3 run in this process (aiohttp); they read ``x-sidecar-upstream``
for who answered. Writes ``benchmarks/results/balance.{md,png,json}`` (``--quick``:
``balance-quick.*``; ``--out STEM``: ``STEM.*``); ``--report-only`` rewrites the
``.md``/``.png`` from the ``.json`` without measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import benchlib as bl
import member_fakes as mf

PATH = "/v1/chat/completions"
BALANCES = ["least_loaded", "ordered", "weighted"]
SCENARIOS = ["speed", "cache", "ramp", "cost"]

# -- the fake upstreams (a child process: ``balance.py fake SPEC``) ---------------------------


def _chunk(content: str | None, finish: str | None) -> bytes:
    delta = {} if content is None else {"content": content}
    doc = {
        "id": "chatcmpl-bal",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-4o",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def _completion(prompt: int, cached: int) -> bytes:
    doc = {
        "id": "chatcmpl-bal",
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
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": 8,
            "total_tokens": prompt + 8,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }
    return json.dumps(doc, separators=(",", ":")).encode()


class FakeMember:
    """One fake upstream: time to first token, a prompt cache per conversation, a mode
    (``ok`` or ``503``) and an optional token bucket (429 above ``rate`` per second)."""

    def __init__(self, name: str, ttft_ms: float, cached_ms: float) -> None:
        self.name = name
        self.ttft_s = ttft_ms / 1000
        self.cached_s = cached_ms / 1000
        self.mode = "ok"
        self.rate = 0.0  # 0: unlimited
        self.burst = 0.0
        self.tokens = 0.0
        self.refilled = 0.0
        self.seen: dict[str, int] = {}  # conversation -> prompt tokens of its last turn
        self.events: list[tuple[float, int]] = []  # (monotonic time of the answer, status)
        self.first_ok_after_switch: float | None = None

    def set(self, **kv: str) -> None:
        if "mode" in kv:
            self.mode = kv["mode"]
            self.first_ok_after_switch = None
        if "rate" in kv:
            self.rate = float(kv["rate"])
            self.burst = float(kv.get("burst", self.rate))
            self.tokens, self.refilled = self.burst, time.monotonic()

    def admit(self) -> bool:
        """The token bucket: whether this request is within the hidden capacity."""
        if self.rate <= 0:
            return True
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.refilled) * self.rate)
        self.refilled = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


async def fake_main(spec: list[dict[str, Any]]) -> None:
    from aiohttp import web

    member_key = web.AppKey("member", FakeMember)
    error = b'{"error":{"message":"%s","type":"%s","param":null,"code":null}}'

    async def handle(request: web.Request) -> web.StreamResponse:
        m = request.app[member_key]
        body = await request.read()
        if m.mode == "503":
            m.events.append((time.monotonic(), 503))
            return web.Response(
                status=503,
                body=error % (b"The server is overloaded.", b"server_error"),
                content_type="application/json",
            )
        if not m.admit():
            m.events.append((time.monotonic(), 429))
            return web.Response(
                status=429,
                body=error % (b"Rate limit reached.", b"rate_limit_exceeded"),
                content_type="application/json",
            )
        doc = json.loads(body)
        messages = doc.get("messages") or []
        key = next((str(x.get("content")) for x in messages if x.get("role") == "user"), "")
        prompt = 64 + len(body) // 4
        prev = m.seen.get(key)
        cached = 0 if prev is None else min(prev, prompt) // 128 * 128
        m.seen[key] = prompt
        await asyncio.sleep(m.cached_s if prev is not None else m.ttft_s)
        now = time.monotonic()
        m.events.append((now, 200))
        if m.first_ok_after_switch is None:
            m.first_ok_after_switch = now
        if not doc.get("stream"):
            return web.Response(body=_completion(prompt, cached), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk("Hello", None))
        for _ in range(3):
            await asyncio.sleep(0.01)
            await resp.write(_chunk(" there", None))
        await resp.write(_chunk(None, "stop") + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def stats(m: FakeMember) -> dict[str, Any]:
        return {
            "events": m.events,
            "first_ok_after_switch": m.first_ok_after_switch,
            "conversations": len(m.seen),
        }

    def reset(m: FakeMember) -> None:
        m.seen.clear()
        m.events.clear()
        m.mode, m.rate, m.first_ok_after_switch = "ok", 0.0, None

    members = [FakeMember(x["name"], x["ttft_ms"], x.get("cached_ms", x["ttft_ms"])) for x in spec]
    await mf.serve_members(members, handle, member_key, stats=stats, reset=reset)


# -- clients (this process) -------------------------------------------------------------------

Rec = dict[str, Any]


async def call(session: Any, url: str, body: bytes, headers: dict[str, str]) -> Rec:
    """One request: send time, status, who answered, time to first body byte, whole
    latency, and for a JSON answer its ``cached_tokens``."""
    import aiohttp

    t0 = time.monotonic()
    rec: Rec = {"t": t0, "status": 0, "up": "", "ttft": float("nan"), "cached": -1, "err": ""}
    parts: list[bytes] = []
    try:
        async with session.post(url, data=body, headers=headers) as r:
            rec["status"] = r.status
            rec["up"] = r.headers.get("x-sidecar-upstream", "")
            parts.append(await r.content.readany())
            rec["ttft"] = time.monotonic() - t0
            async for c in r.content.iter_any():
                parts.append(c)
    except (aiohttp.ClientError, TimeoutError) as exc:
        rec["err"] = type(exc).__name__ or "error"
    rec["lat"] = time.monotonic() - t0
    raw = b"".join(parts)
    if rec["status"] == 200 and raw.startswith(b"{"):
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            usage = json.loads(raw)["usage"]
            rec["cached"] = int(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
    return rec


@contextlib.asynccontextmanager
async def client() -> Any:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        yield s


def chat(messages: list[dict[str, str]], stream: bool = False) -> bytes:
    doc: dict[str, Any] = {"model": "gpt-4o", "messages": messages, "max_tokens": 64}
    if stream:
        doc["stream"] = True
    return json.dumps(doc).encode()


HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
SYSTEM = {"role": "system", "content": "You are a concise assistant. " * 20}


def sidecar(
    procs: bl.Procs, wd: Path, name: str, body: str, log_level: str = "warning"
) -> tuple[bl.Proc, int, int]:
    listen, admin = bl.free_port(), bl.free_port()
    config = bl.write_sidecar_config(
        wd / f"{name}.toml", body, listen=listen, admin=admin, log_level=log_level
    )
    return bl.start_sidecar(procs, name, config), listen, admin


def metrics(admin: int, name: str, label: str) -> dict[str, float]:
    """A metric's samples summed by one label's value."""
    _, body = bl.http_get(admin, "/metrics")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# -- 1. speed: a three-times-slower key -------------------------------------------------------

SPEED_TOML = """request_timeout_ms = 30000

[upstreams.fast]
base_url = "http://127.0.0.1:{fast}"
[upstreams.slow]
base_url = "http://127.0.0.1:{slow}"

[[routes]]
name = "chat"
path_prefix = "/v1/"
balance = "{balance}"
candidates = [{{ upstream = "fast", tier = 0 }}, {{ upstream = "slow", tier = 0 }}]
"""


async def closed_loop(url: str, conc: int, duration: float, body: bytes) -> list[Rec]:
    recs: list[Rec] = []
    async with client() as s:
        stop = time.monotonic() + duration

        async def worker() -> None:
            while time.monotonic() < stop:
                recs.append(await call(s, url, body, HEADERS))

        await asyncio.gather(*(worker() for _ in range(conc)))
    return recs


def speed(procs: bl.Procs, wd: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = [
        {"name": "fast", "ttft_ms": args.fast_ms},
        {"name": "slow", "ttft_ms": args.slow_ms},
    ]
    fake, ports = mf.start_fake(procs, __file__, "fake-speed", spec)
    body = chat([SYSTEM, {"role": "user", "content": "Hello"}], stream=True)
    out = []
    for balance in BALANCES:
        bl.progress(f"speed: balance = {balance}, {args.speed_s:g} s at c={args.concurrency}")
        toml = SPEED_TOML.format(fast=ports["fast"], slow=ports["slow"], balance=balance)
        sc, listen, _ = sidecar(procs, wd, f"speed-{balance}", toml)
        url = f"http://127.0.0.1:{listen}{PATH}"
        recs = asyncio.run(closed_loop(url, args.concurrency, args.speed_s, body))
        procs.stop(sc)
        t0 = min(r["t"] for r in recs)
        ok = [r for r in recs if r["status"] == 200 and not r["err"]]
        seconds = int(args.speed_s + 0.999)
        per_s = {k: [0] * seconds for k in ("fast", "slow")}
        for r in ok:
            sec = min(seconds - 1, int(r["t"] - t0))
            if r["up"] in per_s:
                per_s[r["up"]][sec] += 1
        ttft = sorted(r["ttft"] for r in ok)
        by_up = {k: sorted(r["ttft"] for r in ok if r["up"] == k) for k in ("fast", "slow")}
        # Steady state: after the first 10 s (the TTFT average's time constant is 5 s).
        late = [r for r in ok if r["t"] - t0 >= min(10.0, args.speed_s / 2)]
        res = {
            "balance": balance,
            "requests": len(recs),
            "ok": len(ok),
            "rps": len(ok) / args.speed_s,
            "share_slow": sum(r["up"] == "slow" for r in ok) / max(len(ok), 1),
            "share_slow_steady": sum(r["up"] == "slow" for r in late) / max(len(late), 1),
            "ttft_p50_ms": bl.percentile(ttft, 50) * 1000,
            "ttft_p99_ms": bl.percentile(ttft, 99) * 1000,
            "fast_p50_ms": bl.percentile(by_up["fast"], 50) * 1000,
            "slow_p50_ms": bl.percentile(by_up["slow"], 50) * 1000,
            "per_second": per_s,
            "errors": sorted({r["err"] or f"http_{r['status']}" for r in recs} - {"http_200"}),
        }
        bl.progress(
            f"  slow share {res['share_slow']:.1%} (after 10 s {res['share_slow_steady']:.1%}), "
            f"TTFT p50 {res['ttft_p50_ms']:.0f} ms p99 {res['ttft_p99_ms']:.0f} ms, "
            f"{res['rps']:.1f} req/s"
        )
        out.append(res)
    procs.stop(fake)
    return out


# -- 2. cache: sessions and a prompt cache per member ----------------------------------------

CACHE_TOML = """request_timeout_ms = 30000
{members}
[[routes]]
name = "chat"
path_prefix = "/v1/"
{affinity}candidates = [{candidates}]
"""

CACHE_MEMBER = """
[upstreams.{name}]
base_url = "http://127.0.0.1:{port}"
[upstreams.{name}.circuit_breaker]
failure_threshold = 3
cooldown_ms = {cooldown}
"""

MEMBERS = ["m1", "m2", "m3"]


def cache_toml(ports: dict[str, int] | None, affinity: bool, cooldown: int) -> str:
    members = "".join(
        CACHE_MEMBER.format(name=m, port=ports[m] if ports else m.upper(), cooldown=cooldown)
        for m in MEMBERS
    )
    cands = ", ".join(f'{{ upstream = "{m}", tier = 0 }}' for m in MEMBERS)
    aff = 'affinity_header = "x-session-id"\n' if affinity else ""
    return CACHE_TOML.format(members=members, affinity=aff, candidates=cands)


async def conversations(
    url: str,
    args: argparse.Namespace,
    affinity: bool,
    fail: Callable[[str], Awaitable[float]] | None,
) -> tuple[list[Rec], float, float]:
    """``--sessions`` conversations of ``--turns`` turns, started over 1 s, ``--think-s``
    apart; with ``fail``, one member answers 503 from ``--cache-outage`` s for as long."""
    recs: list[Rec] = []
    t_fail = t_ok = float("nan")
    async with client() as s:
        t0 = time.monotonic()

        async def conversation(i: int) -> None:
            await asyncio.sleep(i / args.sessions)
            messages = [SYSTEM, {"role": "user", "content": f"Conversation {i}: first question"}]
            headers = {**HEADERS, "x-session-id": f"session-{i}"} if affinity else HEADERS
            for turn in range(args.turns):
                rec = await call(s, url, chat(messages), headers)
                rec.update(session=i, turn=turn)
                recs.append(rec)
                messages += [
                    {"role": "assistant", "content": "A short answer from the fake."},
                    {"role": "user", "content": f"Follow-up question {turn + 1}"},
                ]
                await asyncio.sleep(args.think_s)

        async def outage() -> None:
            nonlocal t_fail, t_ok
            assert fail is not None
            await asyncio.sleep(max(0.0, t0 + args.cache_outage - time.monotonic()))
            t_fail = await fail("mode=503")
            await asyncio.sleep(args.cache_outage)
            t_ok = await fail("mode=ok")

        tasks = [conversation(i) for i in range(args.sessions)]
        await asyncio.gather(*tasks, *([outage()] if fail else []))
    return recs, t_fail, t_ok


def hit_ratio(recs: list[Rec]) -> float:
    later = [r for r in recs if r["turn"] > 0 and r["status"] == 200]
    return sum(r["cached"] > 0 for r in later) / len(later) if later else float("nan")


def cache(procs: bl.Procs, wd: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = [{"name": m, "ttft_ms": args.uncached_ms, "cached_ms": args.cached_ms} for m in MEMBERS]
    fake, ports = mf.start_fake(procs, __file__, "fake-cache", spec)
    out = []
    for with_outage in (False, True):
        for affinity in (False, True):
            what = f"affinity {'on' if affinity else 'off'}{', m3 outage' if with_outage else ''}"
            bl.progress(f"cache: {args.sessions} sessions x {args.turns} turns, {what}")
            mf.fake_cmd(fake, "reset")
            toml = cache_toml(ports, affinity, args.cooldown_ms)
            sc, listen, admin = sidecar(procs, wd, f"cache-{int(affinity)}{int(with_outage)}", toml)
            url = f"http://127.0.0.1:{listen}{PATH}"

            async def fail(kv: str) -> float:
                reply = await asyncio.to_thread(mf.fake_cmd, fake, f"set m3 {kv}")
                at: float = reply["at"]
                return at

            t_start = time.monotonic()
            recs, t_fail, t_ok = asyncio.run(
                conversations(url, args, affinity, fail if with_outage else None)
            )
            wall = time.monotonic() - t_start
            aff = metrics(admin, "sidecar_affinity_total", "result")
            opened = metrics(admin, "sidecar_breaker_transitions_total", "to").get("open", 0.0)
            procs.stop(sc)
            recs.sort(key=lambda r: (r["session"], r["turn"]))
            moved_sessions = 0
            changes = 0
            for i in range(args.sessions):
                ups = [r["up"] for r in recs if r["session"] == i and r["status"] == 200]
                n = sum(a != b for a, b in itertools.pairwise(ups))
                changes += n
                moved_sessions += n > 0
            res: dict[str, Any] = {
                "affinity": affinity,
                "outage": with_outage,
                "requests": len(recs),
                "failed": sum(r["status"] != 200 or bool(r["err"]) for r in recs),
                "wall_s": wall,
                "hit_ratio": hit_ratio(recs),
                "member_changes": changes,
                "sessions_changed": moved_sessions,
                "affinity_total": aff,
                "breaker_opened": opened,
                "p50_ms": bl.percentile(sorted(r["lat"] for r in recs), 50) * 1000,
                "p99_ms": bl.percentile(sorted(r["lat"] for r in recs), 99) * 1000,
                "by_member": {m: sum(r["up"] == m for r in recs) for m in MEMBERS},
            }
            if with_outage:
                res["t_fail"], res["t_ok"] = t_fail - t_start, t_ok - t_start
                phases = {
                    "before": [r for r in recs if r["t"] < t_fail],
                    "during": [r for r in recs if t_fail <= r["t"] < t_ok],
                    "after": [r for r in recs if r["t"] >= t_ok],
                }
                for k, rs in phases.items():
                    res[f"hit_{k}"] = hit_ratio(rs)
                    res[f"n_{k}"] = len(rs)
                # Sessions on m3 when it failed: where they were served afterwards.
                on_m3 = {
                    r["session"]
                    for r in recs
                    if r["t"] < t_fail and r["up"] == "m3" and r["status"] == 200
                }
                last_before = {
                    r["session"]: r["up"] for r in recs if r["t"] < t_fail and r["status"] == 200
                }
                res["sessions_on_m3"] = sum(last_before.get(i) == "m3" for i in on_m3)
                res["after_on_m3"] = sum(
                    r["up"] == "m3" for r in phases["after"] if r["status"] == 200
                )
                res["hit_after_m3_sessions"] = hit_ratio(
                    [r for r in phases["after"] if last_before.get(r["session"]) == "m3"]
                )
            res["timeline"] = [
                [round(r["t"] - t_start, 3), r["session"], r["turn"], r["up"], r["cached"] > 0,
                 r["status"]]
                for r in recs
            ]  # fmt: skip
            bl.progress(
                f"  hit ratio {res['hit_ratio']:.1%}, failed {res['failed']}, "
                f"sessions that changed member {moved_sessions}, affinity {aff}"
                + (
                    f", hit before/during/after {res['hit_before']:.1%} / "
                    f"{res['hit_during']:.1%} / {res['hit_after']:.1%}"
                    if with_outage
                    else ""
                )
            )
            out.append(res)
    procs.stop(fake)
    return out


# -- 3. ramp: a primary that comes back with less capacity -----------------------------------

RAMP_TOML = """request_timeout_ms = 30000

[upstreams.primary]
base_url = "http://127.0.0.1:{primary}"
[upstreams.primary.circuit_breaker]
failure_threshold = 3
cooldown_ms = {cooldown}
ramp_ms = {ramp}

[upstreams.backup]
base_url = "http://127.0.0.1:{backup}"

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary" }}, {{ upstream = "backup" }}]
"""


async def open_loop(url: str, rate: float, control: Callable[[], Awaitable[None]]) -> list[Rec]:
    """Requests at ``rate`` per second until ``control`` returns."""
    recs: list[Rec] = []
    body = chat([SYSTEM, {"role": "user", "content": "Hello"}])
    async with client() as s:
        ctl = asyncio.ensure_future(control())
        tasks: set[asyncio.Task[None]] = set()
        t0, i = time.monotonic(), 0

        async def one() -> None:
            recs.append(await call(s, url, body, HEADERS))

        while not ctl.done():
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            task = asyncio.ensure_future(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await ctl
        if tasks:
            await asyncio.wait(list(tasks), timeout=40)
    return recs


def ramp(procs: bl.Procs, wd: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = [{"name": "primary", "ttft_ms": 20}, {"name": "backup", "ttft_ms": 20}]
    fake, ports = mf.start_fake(procs, __file__, "fake-ramp", spec)
    out = []
    for ramp_ms in (0, args.ramp_ms):
        res = ramp_run(procs, wd, args, fake, ports, ramp_ms)
        out.append(res)
    procs.stop(fake)
    return out


def ramp_run(
    procs: bl.Procs,
    wd: Path,
    args: argparse.Namespace,
    fake: bl.Proc,
    ports: dict[str, int],
    ramp_ms: int,
) -> dict[str, Any]:
    """One run of the ramp scenario with ``ramp_ms``."""
    bl.progress(
        f"ramp: ramp_ms = {ramp_ms}, {args.ramp_rate:g} req/s, capacity after the outage "
        f"{args.capacity:g}/s, {args.ramp_window:g} s after the close"
    )
    mf.fake_cmd(fake, "reset")
    toml = RAMP_TOML.format(
        primary=ports["primary"], backup=ports["backup"], cooldown=args.cooldown_ms,
        ramp=ramp_ms,
    )  # fmt: skip
    sc, listen, admin = sidecar(procs, wd, f"ramp-{ramp_ms}", toml)
    url = f"http://127.0.0.1:{listen}{PATH}"
    marks: dict[str, float] = {}

    async def control() -> None:
        await asyncio.sleep(args.ramp_warm)
        marks["fail"] = (await asyncio.to_thread(mf.fake_cmd, fake, "set primary mode=503"))["at"]
        await asyncio.sleep(args.ramp_outage)
        cmd = f"set primary mode=ok rate={args.capacity:g} burst={args.burst:g}"
        marks["ok"] = (await asyncio.to_thread(mf.fake_cmd, fake, cmd))["at"]
        deadline = time.monotonic() + args.cooldown_ms / 1000 + 20
        while time.monotonic() < deadline:  # the probe: the primary's first 200 since
            st = await asyncio.to_thread(mf.fake_cmd, fake, "stats")
            first = st["members"]["primary"]["first_ok_after_switch"]
            if first is not None:
                marks["close"] = first
                break
            await asyncio.sleep(0.05)
        else:
            marks["close"] = time.monotonic()
        marks["m0"] = time.monotonic()
        marks["opened0"] = (await asyncio.to_thread(trans, admin)).get("open", 0.0)
        await asyncio.sleep(max(0.0, marks["close"] + args.ramp_window - time.monotonic()))
        marks["opened1"] = (await asyncio.to_thread(trans, admin)).get("open", 0.0)

    recs = asyncio.run(open_loop(url, args.ramp_rate, control))
    skips = metrics(admin, "sidecar_ramp_skips_total", "upstream").get("primary", 0.0)
    attempts = metrics(admin, "sidecar_upstream_attempts_total", "outcome")
    procs.stop(sc)
    events = mf.fake_cmd(fake, "stats")["members"]
    close, end = marks["close"], marks["close"] + args.ramp_window
    prim = [(t, st) for t, st in events["primary"]["events"] if close <= t < end]
    back = [t for t, st in events["backup"]["events"] if close <= t < end and st == 200]
    window = [r for r in recs if close <= r["t"] < end]
    lat = sorted(r["lat"] for r in window)
    seconds = int(args.ramp_window + 0.999)
    t_base = marks["fail"]
    span = int(end - t_base + 0.999)
    series: dict[str, list[int]] = {k: [0] * span for k in ("p200", "p429", "p503", "b200")}
    for who, key in (("primary", "p"), ("backup", "b")):
        for t, st in events[who]["events"]:
            sec = int(t - t_base)
            name = f"{key}{st}"
            if 0 <= sec < span and name in series:
                series[name][sec] += 1
    res = {
        "ramp_ms": ramp_ms,
        "close_after_ok_s": close - marks["ok"],
        "requests_in_window": len(window),
        "client_failed": sum(r["status"] != 200 or bool(r["err"]) for r in window),
        "primary_429": sum(st == 429 for _, st in prim),
        "primary_200": sum(st == 200 for _, st in prim),
        "backup_200": len(back),
        "primary_share": sum(r["up"] == "primary" for r in window) / max(len(window), 1),
        "reopened": marks["opened1"] - marks["opened0"],
        "ramp_skips": skips,
        "attempts_total": attempts,
        "p50_ms": bl.percentile(lat, 50) * 1000,
        "p99_ms": bl.percentile(lat, 99) * 1000,
        "seconds": seconds,
        "series": series,
        "t_close": close - t_base,
        "t_ok": marks["ok"] - t_base,
        "t_end": end - t_base,
    }
    bl.progress(
        f"  closed {res['close_after_ok_s']:.1f} s after recovery; in {args.ramp_window:g} s: "
        f"primary 429s {res['primary_429']}, primary 200s {res['primary_200']}, backup "
        f"{res['backup_200']}, client failed {res['client_failed']}, reopened "
        f"{res['reopened']:.0f}x, p99 {res['p99_ms']:.0f} ms"
    )
    return res


def trans(admin: int) -> dict[str, float]:
    return metrics(admin, "sidecar_breaker_transitions_total", "to")


# -- 4. cost: the chooser's CPU per request ---------------------------------------------------

COST_TOML = """
[upstreams.a]
base_url = "http://127.0.0.1:{up}"
[upstreams.a.circuit_breaker]
failure_threshold = 3
cooldown_ms = 30000

[upstreams.b]
base_url = "http://127.0.0.1:{up}"
[upstreams.b.circuit_breaker]
failure_threshold = 3
cooldown_ms = 30000

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{cands}]
"""
TIER = '{ upstream = "a", tier = 0 }, { upstream = "b", tier = 0 }'
ORDERED = '{ upstream = "a" }, { upstream = "b" }'


def cpu_of(pids: tuple[int, ...]) -> float:
    return sum(bl.cpu_seconds(p) for p in pids)


def cost(procs: bl.Procs, wd: Path, args: argparse.Namespace) -> dict[str, Any]:
    from loadgen import DEFAULT_BODY
    from overhead import WRK_LUA, run_wrk

    wrk = bl.apt_install("wrk", "wrk")
    if wrk is None:
        print("note: no wrk: the cost scenario is skipped")
        return {}
    lua = wd / "bench.lua"
    lua.write_text(WRK_LUA % DEFAULT_BODY.decode())
    up, up_port = bl.start_upstream(procs, "lean-upstream")
    targets: dict[str, tuple[bl.Proc, int]] = {}
    bare_port = bl.free_port()
    cmd = [bl.PY, str(bl.HERE / "bare_relay.py"), "--port", str(bare_port)]
    bare = procs.start("bare-relay", [*cmd, "--upstream", f"http://127.0.0.1:{up_port}"])
    bl.wait_port(bare_port, bare)
    targets["bare relay"] = (bare, bare_port)
    for name, cands in (("ordered", ORDERED), ("tier", TIER)):
        toml = COST_TOML.format(up=up_port, cands=cands)
        sc, listen, _ = sidecar(procs, wd, f"cost-{name}", toml, log_level="info")
        targets[name] = (sc, listen)
    names = list(targets)
    cells: list[dict[str, Any]] = []
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            proc, port = targets[name]
            foreign = bl.ForeignCpu(functools.partial(cpu_of, (proc.pid, up.pid)))
            c0, u0, t0 = bl.cpu_seconds(proc.pid), bl.cpu_seconds(up.pid), time.monotonic()
            r = run_wrk(wrk, lua, f"http://127.0.0.1:{port}{PATH}", 32, args.cost_s)
            wall = time.monotonic() - t0
            cpu = bl.cpu_seconds(proc.pid) - c0
            cells.append(
                {
                    "rep": rep,
                    "target": name,
                    "requests": r["requests"],
                    "errors": r["errors"],
                    "rps": r["rps"],
                    "p50_ms": r["p50_ms"],
                    "cpu_us_per_req": cpu / max(r["requests"], 1) * 1e6,
                    "upstream_cpu_util": (bl.cpu_seconds(up.pid) - u0) / wall,
                    "foreign_cores": foreign.cores(),
                }
            )
        bl.progress(
            f"cost rep {rep + 1}/{args.reps}: "
            + ", ".join(
                f"{c['target']} {c['cpu_us_per_req']:.0f} us/req {c['rps']:.0f} req/s"
                for c in cells
                if c["rep"] == rep
            )
        )
    for name in names:
        procs.stop(targets[name][0])
    procs.stop(up)
    med = {
        n: {
            k: bl.median([c[k] for c in cells if c["target"] == n])
            for k in ("cpu_us_per_req", "rps", "p50_ms", "foreign_cores", "upstream_cpu_util")
        }
        for n in names
    }
    return {
        "cells": cells,
        "median": med,
        "tier_over_ordered": med["tier"]["cpu_us_per_req"] / med["ordered"]["cpu_us_per_req"],
        "tier_over_bare": med["tier"]["cpu_us_per_req"] / med["bare relay"]["cpu_us_per_req"],
        "ordered_over_bare": med["ordered"]["cpu_us_per_req"] / med["bare relay"]["cpu_us_per_req"],
        "per_rep_tier_over_ordered": [
            next(c for c in cells if c["rep"] == rep and c["target"] == "tier")["cpu_us_per_req"]
            / next(c for c in cells if c["rep"] == rep and c["target"] == "ordered")[
                "cpu_us_per_req"
            ]
            for rep in range(args.reps)
        ],
    }


# -- report ---------------------------------------------------------------------------------


def pct(x: float) -> str:
    return "-" if x != x else f"{x:.1%}"


def speed_md(args: argparse.Namespace, res: list[dict[str, Any]]) -> list[str]:
    if not res:
        return []
    rows = [
        [r["balance"], r["ok"], f"{r['rps']:.1f}", pct(r["share_slow"]),
         pct(r["share_slow_steady"]), r["ttft_p50_ms"], r["ttft_p99_ms"], r["fast_p50_ms"],
         r["slow_p50_ms"], ", ".join(r["errors"]) or "none"]
        for r in res
    ]  # fmt: skip
    by = {r["balance"]: r for r in res}
    lines = [
        "## 1. A key three times slower: the share each key gets",
        "",
        f"Two keys in one tier (equal weights): `fast` answers its first token after "
        f"{args.fast_ms:g} ms, `slow` after {args.slow_ms:g} ms (then 3 more events 10 ms "
        f"apart). A closed loop of {args.concurrency} streaming clients for {args.speed_s:g} s "
        "per `balance`, a fresh sidecar each. TTFT = request sent -> first body byte at the "
        "client.",
        "",
        bl.md_table(
            [
                "balance",
                "requests",
                "req/s",
                "slow share",
                "slow share after 10 s",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "fast p50 ms",
                "slow p50 ms",
                "errors",
            ],
            rows,
        ),
        "",
    ]
    if {"least_loaded", "ordered", "weighted"} <= by.keys():
        ll, od, wt = by["least_loaded"], by["ordered"], by["weighted"]
        lines += [
            f"**Reading.** `least_loaded` sent {pct(ll['share_slow_steady'])} of the requests "
            f"to the slow key once its time-to-first-output average had samples (after 10 s; "
            f"{pct(ll['share_slow'])} over the whole run): the contract asks at most a quarter "
            "within 30 s and at least 2 %, and the README says about 12 %. Its TTFT p50 is "
            f"{ll['ttft_p50_ms']:.0f} ms against `weighted`'s {wt['ttft_p50_ms']:.0f} ms "
            f"(half the requests on the slow key: p99 {wt['ttft_p99_ms']:.0f} ms) and "
            f"`ordered`'s {od['ttft_p50_ms']:.0f} ms (the first key only, slow share "
            f"{pct(od['share_slow'])}); `least_loaded`'s p99, {ll['ttft_p99_ms']:.0f} ms, is the "
            "slow key's share it keeps so its recovery is seen. Throughput follows: "
            f"{ll['rps']:.1f} / {wt['rps']:.1f} / {od['rps']:.1f} req/s (least_loaded / "
            "weighted / ordered) from the same closed loop.",
            "",
            "Why not 1/9 (about 11-12 %, the README's figure): the effective weight is "
            "`weight / ((1 + in_flight / weight) * slowness^2)`, and under a closed loop the "
            "fast key holds most of the requests in flight (by Little's law, with a slow share "
            "p: in flight fast / slow = (1-p) x 100 ms : p x 300 ms, about 5 : 3 of 8 at "
            "p = 16 %), so its effective weight is divided by about 6 and the slow key's by "
            "about 4 x 9; with the 2 % floor that settles near 16 %. 1/9 is the share with "
            "no calls in flight; the contract's bound (a quarter) holds.",
            "",
        ]
    return lines


def cache_md(args: argparse.Namespace, res: list[dict[str, Any]]) -> list[str]:
    if not res:
        return []
    rows = []
    for r in res:
        aff = r["affinity_total"]
        rows.append(
            [
                "on" if r["affinity"] else "off",
                "m3 503s" if r["outage"] else "none",
                r["requests"],
                r["failed"],
                pct(r["hit_ratio"]),
                pct(r.get("hit_before", float("nan"))),
                pct(r.get("hit_during", float("nan"))),
                pct(r.get("hit_after", float("nan"))),
                r["sessions_changed"],
                r["member_changes"],
                " / ".join(f"{aff.get(k, 0):.0f}" for k in ("new", "kept", "moved"))
                if r["affinity"]
                else "-",
                " / ".join(str(r["by_member"][m]) for m in MEMBERS),
                r["p50_ms"],
                r["p99_ms"],
            ]
        )
    lines = [
        "## 2. Sessions and a prompt cache per member",
        "",
        f"Three members in one tier (`least_loaded`), each a fake with its own prompt cache: "
        f"a conversation (keyed by its first user message) a member has answered before is "
        f"answered in {args.cached_ms:g} ms with `usage.prompt_tokens_details.cached_tokens` "
        f"> 0, else in {args.uncached_ms:g} ms with 0. {args.sessions} conversations x "
        f"{args.turns} turns (JSON), started over 1 s, {args.think_s:g} s of think time "
        "between turns; affinity on = the client sends `x-session-id` and the route has "
        '`affinity_header = "x-session-id"`. Outage: m3 answers 503 from '
        f"{args.cache_outage:g} s after the start for {args.cache_outage:g} s (breakers: "
        f"`failure_threshold = 3`, `cooldown_ms = {args.cooldown_ms}`; default retries). "
        "**Hit ratio** = turns 2-10 answered 200 with cached tokens / all turns 2-10 "
        "answered 200 (a perfect placement gives 100 %); before / during / after split the "
        "turns by their send time around the outage.",
        "",
        bl.md_table(
            [
                "affinity",
                "outage",
                "requests",
                "failed",
                "hit ratio",
                "before",
                "during",
                "after",
                "sessions that changed member",
                "member changes",
                "affinity new / kept / moved",
                "served by m1 / m2 / m3",
                "p50 ms",
                "p99 ms",
            ],
            rows,
        ),
        "",
    ]
    by = {(r["affinity"], r["outage"]): r for r in res}
    if len(by) == 4:
        off, on = by[(False, False)], by[(True, False)]
        offo, ono = by[(False, True)], by[(True, True)]
        lines += [
            f"**Reading.** Without affinity a conversation lands wherever `least_loaded` "
            f"draws, so a turn finds its prefix cached only when that member happened to "
            f"serve the conversation before: {pct(off['hit_ratio'])} of turns 2-10. With "
            f"`x-session-id` every later turn goes to the member that holds the prefix: "
            f"{pct(on['hit_ratio'])}. Through m3's outage, affinity on: "
            f"{ono.get('sessions_on_m3', 0)} sessions were on m3; `moved` counted "
            f"{ono['affinity_total'].get('moved', 0):.0f}; the hit ratio was "
            f"{pct(ono['hit_before'])} before, {pct(ono['hit_during'])} during (a moved "
            f"session's first turn on its new member misses) and {pct(ono['hit_after'])} after "
            f"(m3 served {ono['after_on_m3']} requests after its recovery: moved sessions stay "
            f"where they went); the sessions that were on m3 hit "
            f"{pct(ono['hit_after_m3_sessions'])} after. Affinity off through the same outage: "
            f"{pct(offo['hit_ratio'])} overall, {pct(offo['hit_after'])} after. Failed "
            f"requests: {offo['failed']} (off) and {ono['failed']} (on): a failure on m3 "
            "moved on to another member.",
            "",
        ]
    return lines


def ramp_md(args: argparse.Namespace, res: list[dict[str, Any]]) -> list[str]:
    if not res:
        return []
    rows = [
        [r["ramp_ms"], f"{r['close_after_ok_s']:.1f}", r["requests_in_window"],
         r["client_failed"], r["primary_429"], r["primary_200"], r["backup_200"],
         pct(r["primary_share"]), f"{r['reopened']:.0f}", f"{r['ramp_skips']:.0f}",
         r["p50_ms"], r["p99_ms"]]
        for r in res
    ]  # fmt: skip
    lines = [
        "## 3. Recovery with hidden capacity: `ramp_ms`",
        "",
        f"Ordered route `primary`, then `backup` (both fakes answer in 20 ms); open-loop "
        f"{args.ramp_rate:g} JSON requests/s. The primary serves everything for "
        f"{args.ramp_warm:g} s, answers 503 for {args.ramp_outage:g} s, then comes back able "
        f"to serve only {args.capacity:g} requests/s (a token bucket, burst "
        f"{args.burst:g}; 429 above it, no `Retry-After`). Primary breaker "
        f"`failure_threshold = 3`, `cooldown_ms = {args.cooldown_ms}`, default retries "
        "(429 is retried, 1 + 2 attempts, and a breaker failure). Counted from the close "
        f"(the probe's 200 at the primary) for {args.ramp_window:g} s.",
        "",
        bl.md_table(
            [
                "ramp_ms",
                "close after recovery s",
                "requests",
                "client failed",
                "primary 429s",
                "primary 200s",
                "backup 200s",
                "answered by primary",
                "breaker reopened",
                "ramp skips",
                "p50 ms",
                "p99 ms",
            ],
            rows,
        ),
        "",
    ]
    if len(res) == 2:
        a, b = res
        lines += [
            f"**Reading.** With `ramp_ms = 0` the close sends the whole "
            f"{args.ramp_rate:g}/s back at once: the primary answered {a['primary_429']} 429s in "
            f"the {args.ramp_window:g} s and its breaker reopened {a['reopened']:.0f} time(s); "
            f"with `ramp_ms = {b['ramp_ms']}` it answered {b['primary_429']} 429s and "
            f"reopened {b['reopened']:.0f} time(s) (a failure during the ramp reopens at once, "
            "so each ramp ends at the first 429 above the hidden capacity, and the next probe "
            f"starts a new one). The primary served {a['primary_200']} vs {b['primary_200']} "
            f"requests; the backup took the rest, so the client saw {a['client_failed']} vs "
            f"{b['client_failed']} failed requests; p99 {a['p99_ms']:.0f} vs "
            f"{b['p99_ms']:.0f} ms (a 429 on the primary is retried after 250 and 500 ms "
            "before the backup is tried, unless the breaker opened meanwhile).",
            "",
            "Two things the per-second counts in the chart show. Without a ramp the "
            "consecutive-failure rule (`failure_threshold = 3`) hardly ever trips on a "
            "rate-limited primary: the token bucket lets a success through every "
            f"1/{args.capacity:g} s, evenly spaced, and each success resets the count, so the "
            "primary keeps taking the whole load plus two retries per 429 (three to four "
            "429s per success, far above the offered rate); `failure_rate_threshold` is the "
            'rule for this (not enabled here). With the ramp, "a failure during the ramp '
            'reopens at once" counts *calls*: the call that met the first 429 is retried '
            "(250 + 500 ms) before it is recorded, and calls admitted meanwhile meet 429s "
            "too, so each ramp ends with one to two seconds of 429s rather than one.",
            "",
        ]
    return lines


def cost_md(args: argparse.Namespace, res: dict[str, Any]) -> list[str]:
    if not res:
        return []
    med = res["median"]
    rows = [
        [n, f"{m['cpu_us_per_req']:.0f}", f"{m['rps']:,.0f}", f"{m['p50_ms']:.2f}",
         f"{m['upstream_cpu_util']:.2f}", f"{m['foreign_cores']:.2f}"]
        for n, m in med.items()
    ]  # fmt: skip
    per = ", ".join(f"{x:.3f}" for x in res["per_rep_tier_over_ordered"])
    return [
        "## 4. The chooser's cost: CPU per request",
        "",
        f"The same lean upstream (`upstream.py`, JSON) behind two upstream entries `a` and "
        f"`b`; one sidecar with `candidates = [a, b]` in order, one with both in tier 0 "
        f"(`least_loaded`), and the bare relay; wrk, one thread, c=32, {args.cost_s:g} s per "
        f"cell, {args.reps} repetitions with the order rotated. CPU = utime + stime of the "
        "proxy process from `/proc/<pid>/stat` over the cell, per request; medians over "
        'repetitions. Sidecars at `log_level = "info"` with the access log on, as '
        "`overhead.py`.",
        "",
        bl.md_table(
            ["target", "CPU us/req", "req/s", "p50 ms", "upstream CPU", "other load (cores)"],
            rows,
        ),
        "",
        f"- **tier / ordered** (ratio of the medians): **{res['tier_over_ordered']:.3f}**; "
        f"per repetition: {per}",
        f"- tier / bare relay: {res['tier_over_bare']:.3f}; ordered / bare relay: "
        f"{res['ordered_over_bare']:.3f}",
        "",
        f"**Reading.** Choosing a member (a `least_loaded` draw over two members: their "
        f"stats, the shares, one random number, plus the in-flight count and the TTFO "
        f"average kept per call) costs {res['tier_over_ordered'] - 1:+.1%} CPU per request "
        "against walking an ordered list; "
        + (
            "every repetition measured the tier dearer "
            f"({min(res['per_rep_tier_over_ordered']):.3f} to "
            f"{max(res['per_rep_tier_over_ordered']):.3f}), so the difference is not the "
            "machine's noise alone."
            if min(res["per_rep_tier_over_ordered"]) > 1
            else "the per-repetition ratios straddle 1: within this machine's noise."
        )
        + " One confound: the tier spreads its calls over two connection pools (`a` and "
        "`b`), the ordered route keeps them all on `a`'s.",
        "",
    ]


def report(
    args: argparse.Namespace, info: dict[str, str], results: dict[str, Any], command: str
) -> str:
    samples = []
    if results.get("speed"):
        samples.append(SPEED_TOML.format(fast="F", slow="S", balance="least_loaded"))
    if results.get("cache"):
        samples.append(cache_toml(None, True, args.cooldown_ms))
    if results.get("ramp"):
        samples.append(RAMP_TOML.format(primary="P", backup="B", cooldown=args.cooldown_ms,
                                        ramp=args.ramp_ms))  # fmt: skip
    if results.get("cost"):
        samples.append(COST_TOML.format(up="U", cands=TIER))
    lines = [
        "# Equal candidates (#22): shares, sessions, paced recovery, cost",
        "",
        f"Command: `{command}`",
        "",
        bl.machine_md(info),
        "",
        f"Took {results['took_min']:.1f} min. Every process on 127.0.0.1; the fake "
        "upstreams of scenarios 1-3 are aiohttp servers in one child process "
        "(`balance.py fake`), the clients of 1-3 aiohttp in the benchmark's own process.",
        "",
        *speed_md(args, results.get("speed", [])),
        *cache_md(args, results.get("cache", [])),
        *ramp_md(args, results.get("ramp", [])),
        *cost_md(args, results.get("cost", {})),
        "![balance](balance.png)",
        "",
        "## Sidecar configs",
        "",
        "Scenario 1 (`balance` per run), 2 (affinity on; off = without "
        "`affinity_header`), 3 (`ramp_ms` per run; `max_retries` default), 4 (tier; "
        "ordered = the same without `tier`):",
        "",
    ]
    for s in samples:
        lines += [*bl.sidecar_config_md(s), ""]
    return "\n".join(lines) + "\n"


def chart(path: Path, args: argparse.Namespace, results: dict[str, Any]) -> bool:
    plt = bl.matplotlib_pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(4, 2, figsize=(14, 17))
    sp = results.get("speed") or []
    ax = axes[0][0]
    for r in sp:
        f, s = r["per_second"]["fast"], r["per_second"]["slow"]
        share = [b / (a + b) if a + b else float("nan") for a, b in zip(f, s, strict=True)]
        ax.plot(range(len(share)), share, label=r["balance"], marker=".")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("second of the run")
    ax.set_ylabel("share of requests to the slow key")
    ax.set_title(f"1. slow key ({args.slow_ms:g} ms TTFT vs {args.fast_ms:g}): share per second",
                 fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3)
    if sp:
        ax.legend(fontsize=8)
    ax = axes[0][1]
    xs = range(len(sp))
    ax.bar([x - 0.2 for x in xs], [r["ttft_p50_ms"] for r in sp], 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [r["ttft_p99_ms"] for r in sp], 0.4, label="p99")
    ax.set_xticks(list(xs), [r["balance"] for r in sp])
    ax.set_ylabel("time to first token, ms")
    ax.set_title("1. client TTFT by balance", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    if sp:
        ax.legend(fontsize=8)

    ca = results.get("cache") or []
    ax = axes[1][0]
    labels = [f"affinity {'on' if r['affinity'] else 'off'}\n{'m3 outage' if r['outage'] else ''}"
              for r in ca]  # fmt: skip
    ax.bar(range(len(ca)), [r["hit_ratio"] for r in ca], color="tab:green")
    ax.set_xticks(range(len(ca)), labels, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("cache hit ratio, turns 2-10")
    ax.set_title("2. prompt cache hits", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax = axes[1][1]
    outs = [r for r in ca if r["outage"]]
    for k, r in enumerate(outs):
        vals = [r[f"hit_{p}"] for p in ("before", "during", "after")]
        ax.bar([x + 0.4 * k - 0.2 for x in range(3)], vals, 0.4,
               label=f"affinity {'on' if r['affinity'] else 'off'}")  # fmt: skip
    ax.set_xticks(range(3), ["before", "during m3's 503s", "after"])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("cache hit ratio")
    ax.set_title("2. hit ratio around m3's outage", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    if outs:
        ax.legend(fontsize=8)

    rp = results.get("ramp") or []
    for k, r in enumerate(rp[:2]):
        ax = axes[2][k]
        ser = r["series"]
        x = list(range(len(ser["p200"])))
        ax.stackplot(
            x, ser["p200"], ser["p429"], ser["p503"], ser["b200"],
            labels=["primary 200", "primary 429", "primary 503", "backup 200"],
            colors=["tab:blue", "tab:red", "tab:orange", "tab:green"], alpha=0.8,
        )  # fmt: skip
        ax.axvline(r["t_ok"], color="k", ls=":", lw=1)
        ax.axvline(r["t_close"], color="k", ls="--", lw=1)
        ax.set_xlabel("seconds since the outage began (dotted: recovery, dashed: close)")
        ax.set_ylabel("answers per second (upstream side)")
        ax.set_title(
            f"3. ramp_ms = {r['ramp_ms']}: {r['primary_429']} primary 429s, reopened "
            f"{r['reopened']:.0f}x in {args.ramp_window:g} s after the close",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")

    co = results.get("cost") or {}
    ax = axes[3][0]
    if co:
        names = list(co["median"])
        for i, n in enumerate(names):
            vals = [c["cpu_us_per_req"] for c in co["cells"] if c["target"] == n]
            ax.scatter([i] * len(vals), vals, s=14, alpha=0.7)
            ax.hlines(co["median"][n]["cpu_us_per_req"], i - 0.25, i + 0.25, color="k")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("proxy CPU us per request")
        ax.set_title(
            f"4. CPU per JSON request, c=32 (tier / ordered = {co['tier_over_ordered']:.3f})",
            fontsize=9,
        )
        ax.grid(alpha=0.3, axis="y")
    axes[3][1].axis("off")
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
    p.add_argument("--quick", action="store_true", help="shorter runs (about 3 minutes)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--out", default=None, help="results file stem in benchmarks/results")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--speed-s", type=float, default=None)
    p.add_argument("--fast-ms", type=float, default=100)
    p.add_argument("--slow-ms", type=float, default=300)
    p.add_argument("--sessions", type=int, default=50)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--think-s", type=float, default=1.0)
    p.add_argument("--cached-ms", type=float, default=50)
    p.add_argument("--uncached-ms", type=float, default=200)
    p.add_argument("--cache-outage", type=float, default=4.0, help="start and length, s")
    p.add_argument("--cooldown-ms", type=int, default=5000)
    p.add_argument("--ramp-rate", type=float, default=40)
    p.add_argument("--capacity", type=float, default=20)
    p.add_argument("--burst", type=float, default=10)
    p.add_argument("--ramp-ms", type=int, default=20000)
    p.add_argument("--ramp-warm", type=float, default=3)
    p.add_argument("--ramp-outage", type=float, default=10)
    p.add_argument("--ramp-window", type=float, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--cost-s", type=float, default=None)
    p.add_argument("--report-only", action="store_true", help="rewrite STEM.md/png from STEM.json")
    args = p.parse_args()
    if args.report_only:
        write_outputs(args.out or ("balance-quick" if args.quick else "balance"))
        return 0
    args.speed_s = args.speed_s or (12.0 if args.quick else 40.0)
    args.ramp_window = args.ramp_window or (20.0 if args.quick else 60.0)
    args.reps = args.reps or (3 if args.quick else 7)
    args.cost_s = args.cost_s or (2.0 if args.quick else 5.0)
    if args.quick:
        args.sessions, args.turns = min(args.sessions, 20), min(args.turns, 6)
        args.think_s = min(args.think_s, 0.5)
        args.cache_outage = min(args.cache_outage, 1.5)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if not scenarios or set(scenarios) - set(SCENARIOS):
        p.error(f"--scenarios: pick from {', '.join(SCENARIOS)}")
    stem = args.out or ("balance-quick" if args.quick else "balance")
    results = bl.run_scenarios(
        "balance",
        stem,
        args,
        {"speed": speed, "cache": cache, "ramp": ramp, "cost": cost},
        scenarios,
    )
    print(write_outputs(stem))
    print(f"took {results['took_min']:.1f} min")
    return 0


def write_outputs(stem: str) -> str:
    """``STEM.md`` and ``STEM.png`` from ``STEM.json`` (a run's, or an earlier one's)."""
    return bl.scenario_outputs(stem, "balance.png", report, chart)


if __name__ == "__main__":
    sys.exit(main())

"""Hedged first token (#24, item 4): a heavy-tailed primary, hedge_after_ms off, 1000, 2000.

    .venv/bin/python benchmarks/hedging.py [--quick] [--hedges 0,1000,2000]
                                           [--requests N] [--concurrency C] [--out STEM]

One scenario, run once per ``hedge_after_ms`` of ``--hedges`` (0 = off), each with its
own sidecar (``sidecar serve``) in front of two fake upstreams on loopback:

* ``primary``: streams (SSE) its answer's status and headers at once and its first
  output event after a time to first token drawn from a seeded ``random.Random``: the
  ``--tail-s`` (8 s) for ``--tail-share`` (5 %) of the requests it reads, else
  ``--fast-s`` (0.3 s); then ``--events`` (8) output events ``--gap-ms`` (20 ms)
  apart and ``[DONE]``;
* ``secondary``: the same answer, always after ``--fast-s`` (a healthy second
  candidate);
* the route ``chat``: ``[primary, secondary]`` with ``hedge_after_ms``; no retries
  (``max_retries = 0``), no breaker, the default retry budget.

``--requests`` (600) streamed chat completions (``"stream": true``) from a pool of
``--concurrency`` (16) aiohttp clients, each starting its next request when its last
one ended. Per run: time to first token as the client sees it (the first body chunk)
p50/p90/p99/max, time to the end of the answer p50/p99, success rate, upstream calls
per request (the requests the fakes read) and the extra ones hedging cost, the
sidecar's ``sidecar_hedges_total`` by result and ``cancelled`` attempts.

``--quick``: 120 requests with every time scaled by 1/4 (0.075 s and 2 s; hedges
250 and 500 ms): a check that it runs, in a few seconds, not a measurement.
``--scale F`` scales the times (and the hedges) the same way.

The fakes run in one child process (``hedging.py fake SPEC``: an aiohttp server per
member on a port from binding 0, controlled through stdin); the clients in this
process. Writes ``benchmarks/results/hedging.{md,png,json}`` (``--quick``:
``hedging-quick.*``; ``--out STEM``: ``STEM.*``); ``--report-only`` rewrites the
``.md``/``.png`` from the ``.json`` without measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl
import member_fakes as mf

PATH = "/v1/chat/completions"
BODY = json.dumps(
    {
        "model": "gpt-4o",
        "stream": True,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 16,
    }
).encode()
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}


def event(content: str) -> bytes:
    chunk = {
        "id": "chatcmpl-hedge",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-4o",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


# -- the fake upstreams (a child process: ``hedging.py fake SPEC``) ----------------------------


class FakeMember:
    """One fake upstream: each request it reads draws its time to first token from
    ``random.Random(seed)`` (``tail_s`` for a ``tail`` share, else ``fast_s``)."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.seed = seed
        self.rand = random.Random(seed)
        self.tail = 0.0
        self.tail_s = 8.0
        self.fast_s = 0.3
        self.events = 8
        self.gap_s = 0.02
        self.counts = {"requests": 0, "tail": 0, "completed": 0, "cut": 0}

    def set(self, **kv: str) -> None:
        for k in ("tail", "tail_s", "fast_s", "gap_s"):
            if k in kv:
                setattr(self, k, float(kv[k]))
        if "events" in kv:
            self.events = int(kv["events"])

    def reset(self) -> None:
        self.rand = random.Random(self.seed)
        self.counts = dict.fromkeys(self.counts, 0)


async def fake_main(spec: list[dict[str, Any]]) -> None:
    from aiohttp import web

    member_key = web.AppKey("member", FakeMember)

    async def handle(request: web.Request) -> web.StreamResponse:
        m = request.app[member_key]
        await request.read()
        m.counts["requests"] += 1
        slow = m.rand.random() < m.tail
        m.counts["tail"] += slow
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await asyncio.sleep(m.tail_s if slow else m.fast_s)
            for i in range(m.events):
                await resp.write(event(f"w{i} "))
                await asyncio.sleep(m.gap_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionError):
            m.counts["cut"] += 1  # the sidecar closed it: a hedge's loser
            raise
        m.counts["completed"] += 1
        return resp

    members = [FakeMember(x["name"], x["seed"]) for x in spec]
    # handler_cancellation: a loser's handler ends when the sidecar closes it.
    await mf.serve_members(members, handle, member_key, stats=lambda m: dict(m.counts),
                           reset=FakeMember.reset, handler_cancellation=True)  # fmt: skip


# -- the sidecar and the clients --------------------------------------------------------------

TOML = """request_timeout_ms = 60000

[upstreams.primary]
base_url = "http://127.0.0.1:{primary}"

[upstreams.primary.retry]
max_retries = 0

[upstreams.secondary]
base_url = "http://127.0.0.1:{secondary}"

[upstreams.secondary.retry]
max_retries = 0

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary" }}, {{ upstream = "secondary" }}]
hedge_after_ms = {hedge}
"""


def metrics(admin: int, name: str, label: str) -> dict[str, float]:
    """A metric's samples summed by one label's value."""
    _, body = bl.http_get(admin, "/metrics")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def client_pool(url: str, requests: int, conc: int) -> list[dict[str, Any]]:
    """``requests`` streamed requests from ``conc`` clients; each record: status, the
    upstream relayed, time to first body chunk and to the end, an error name."""
    import aiohttp

    recs: list[dict[str, Any]] = []
    left = requests
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                t0 = time.monotonic()
                rec: dict[str, Any] = {"status": 0, "up": "", "err": "", "ttft": None}
                try:
                    async with s.post(url, data=BODY, headers=HEADERS) as r:
                        rec["status"] = r.status
                        rec["up"] = r.headers.get("x-sidecar-upstream", "")
                        rec["attempts"] = int(r.headers.get("x-sidecar-attempts", "0"))
                        first = await r.content.readany()
                        rec["ttft"] = time.monotonic() - t0
                        body = first + await r.read()
                        rec["done"] = body.endswith(b"data: [DONE]\n\n")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    rec["err"] = type(exc).__name__ or "error"
                rec["total"] = time.monotonic() - t0
                recs.append(rec)

        await asyncio.gather(*(worker() for _ in range(conc)))
    return recs


def pct(values: list[float], p: float) -> float:
    return bl.percentile(sorted(values), p) * 1000 if values else float("nan")


def run(procs: bl.Procs, wd: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = [{"name": "primary", "seed": args.seed}, {"name": "secondary", "seed": args.seed + 1}]
    fake, ports = mf.start_fake(procs, __file__, "fake-hedging", spec)
    sc_ = args.scale
    common = f"fast_s={args.fast_s * sc_} gap_s={args.gap_ms / 1000 * sc_} events={args.events}"
    mf.fake_cmd(fake, f"set primary tail={args.tail_share} tail_s={args.tail_s * sc_} {common}")
    mf.fake_cmd(fake, f"set secondary tail=0 {common}")
    out = []
    for hedge in args.hedge_list:
        hedge_ms = round(hedge * sc_)
        label = "off" if hedge_ms == 0 else f"{hedge_ms} ms"
        bl.progress(f"hedge_after_ms {label}: {args.requests} requests at c={args.concurrency}")
        mf.fake_cmd(fake, "reset")
        listen, admin = bl.free_port(), bl.free_port()
        toml = TOML.format(primary=ports["primary"], secondary=ports["secondary"], hedge=hedge_ms)
        config = bl.write_sidecar_config(wd / f"hedge-{hedge_ms}.toml", toml, listen=listen,
                                         admin=admin)  # fmt: skip
        sc = bl.start_sidecar(procs, f"sidecar-hedge-{hedge_ms}", config)
        started = time.monotonic()
        recs = asyncio.run(
            client_pool(f"http://127.0.0.1:{listen}{PATH}", args.requests, args.concurrency)
        )
        took = time.monotonic() - started
        counts = mf.fake_cmd(fake, "stats")["members"]
        hedges = metrics(admin, "sidecar_hedges_total", "result")
        outcomes = metrics(admin, "sidecar_upstream_attempts_total", "outcome")
        procs.stop(sc)
        n = len(recs)
        ok = [r for r in recs if r["status"] == 200 and not r["err"] and r.get("done")]
        ttft = [r["ttft"] for r in ok]
        calls = counts["primary"]["requests"] + counts["secondary"]["requests"]
        r = {
            "hedge_after_ms": hedge_ms,
            "label": label,
            "requests": n,
            "took_s": took,
            "success": len(ok) / max(n, 1),
            "answered_by": {
                u: sum(1 for x in ok if x["up"] == u) for u in ("primary", "secondary")
            },
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p90_ms": pct(ttft, 90),
            "ttft_p99_ms": pct(ttft, 99),
            "ttft_max_ms": max(ttft, default=float("nan")) * 1000,
            "total_p50_ms": pct([x["total"] for x in ok], 50),
            "total_p99_ms": pct([x["total"] for x in ok], 99),
            "upstream_calls": calls,
            "calls_per_request": calls / max(n, 1),
            "extra_calls_per_request": (calls - n) / max(n, 1),
            "primary_tail_draws": counts["primary"]["tail"],
            "fakes": counts,
            "hedges": hedges,
            "cancelled_attempts": outcomes.get("cancelled", 0.0),
            "ttft_ms": sorted(round(x * 1000, 2) for x in ttft),
        }
        bl.progress(
            f"  success {r['success']:.1%}, TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 "
            f"{r['ttft_p99_ms']:.0f} ms, extra calls/request {r['extra_calls_per_request']:.3f}, "
            f"hedges {hedges}"
        )
        out.append(r)
    procs.stop(fake)
    return out


# -- report -----------------------------------------------------------------------------------


def report(
    args: argparse.Namespace, info: dict[str, str], results: dict[str, Any], command: str
) -> str:
    res: list[dict[str, Any]] = results.get("hedging", [])
    sc_ = args.scale
    rows = [
        [
            r["label"],
            r["requests"],
            f"{r['success']:.1%}",
            f"{r['ttft_p50_ms']:,.0f}",
            f"{r['ttft_p90_ms']:,.0f}",
            f"{r['ttft_p99_ms']:,.0f}",
            f"{r['ttft_max_ms']:,.0f}",
            f"{r['total_p99_ms']:,.0f}",
            f"{r['extra_calls_per_request']:.3f}",
            ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["hedges"].items())) or "-",
            int(r["cancelled_attempts"]),
            r["answered_by"]["secondary"],
        ]
        for r in res
    ]
    head = ["hedge_after_ms", "requests", "success", "TTFT p50 ms", "TTFT p90 ms",
            "TTFT p99 ms", "TTFT max ms", "end p99 ms", "extra upstream calls / request",
            "hedges (sidecar_hedges_total)", "cancelled attempts",
            "answered by secondary"]  # fmt: skip
    reading: list[str] = []
    by = {r["hedge_after_ms"]: r for r in res}
    off = by.get(0)
    hedged = [r for r in res if r["hedge_after_ms"] > 0]
    if off is not None and hedged:
        parts = [
            f"`{r['label']}`: p99 {r['ttft_p99_ms']:,.0f} ms for "
            f"{r['extra_calls_per_request']:.1%} more upstream calls"
            for r in hedged
        ]
        reading = [
            f"**Reading.** Without hedging the primary's tail is the client's: TTFT p99 "
            f"{off['ttft_p99_ms']:,.0f} ms ({off['primary_tail_draws']} of "
            f"{off['requests']} requests drew the {args.tail_s * sc_:g} s tail). With "
            f"hedging: {'; '.join(parts)}. A hedge is sent only for the requests still "
            "without a first token at `hedge_after_ms`, so its cost is about the tail's "
            "share (plus the fast requests that happen to cross the threshold), and each "
            "hedged request's time to first token is about `hedge_after_ms` plus the "
            "second candidate's. The median does not move: the fast requests never hedge.",
            "",
        ]
        skipped = [r["label"] for r in hedged if r["hedges"].get("not_sent")]
        if skipped:
            reading[-1:] = [
                f"A `not_sent` hedge ({', '.join(f'`{s}`' for s in skipped)}) was due "
                "when the secondary's retry budget was spent (the default: more than "
                "max(3, 20 % of its requests) retries and hedges in flight: here "
                "the secondary's only requests are hedges, so three at once): that "
                "request waited out the primary's tail (the max column), as the budget "
                "means it to.",
                "",
            ]
    lines = [
        "# Hedged first token (#24): a heavy-tailed primary, `hedge_after_ms` off and on",
        "",
        f"Command: `{command}`",
        "",
        bl.machine_md(info),
        "",
        f"Took {results['took_min']:.1f} min. Every process on 127.0.0.1; the fakes are "
        "aiohttp servers in one child process (`hedging.py fake`), the clients run in the "
        "benchmark's own process.",
        "",
        f"{args.requests} streamed chat completions per run from {args.concurrency} "
        "aiohttp clients (each starts its next request when its last one ended). The "
        f"primary sends its first output event after {args.fast_s * sc_:g} s, or "
        f"{args.tail_s * sc_:g} s for a seeded {args.tail_share:.0%} of the requests it "
        f"reads; the secondary always after {args.fast_s * sc_:g} s; then "
        f"{args.events} events {args.gap_ms * sc_:g} ms apart. No retries, no breaker, "
        "the default retry budget. *TTFT*: request sent to the first body chunk, as the "
        "client sees it; *extra upstream calls*: requests the fakes read beyond one per "
        "client request."
        + (f" Times scaled by {sc_:g} (`--scale`/`--quick`)." if sc_ != 1 else ""),
        "",
        bl.md_table(head, rows),
        "",
        *reading,
        "![hedging](hedging.png)",
        "",
        "## Sidecar config",
        "",
        *bl.sidecar_config_md(TOML.format(primary="P", secondary="S", hedge=1000)),
    ]
    return "\n".join(lines) + "\n"


def chart(path: Path, args: argparse.Namespace, results: dict[str, Any]) -> bool:
    plt = bl.matplotlib_pyplot()
    if plt is None:
        return False
    res: list[dict[str, Any]] = results.get("hedging", [])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    for r in res:
        lat = r["ttft_ms"]
        if lat:
            ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=r["label"])
    ax.set_xscale("log")
    ax.set_ylim(0.8, 1.001)
    ax.set_xlabel("time to first token, ms (log)")
    ax.set_ylabel("share of requests (CDF, top 20 %)")
    ax.set_title("time to first token by hedge_after_ms", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if res:
        ax.legend(fontsize=8, title="hedge_after_ms", title_fontsize=8)
    ax = axes[1]
    xs = range(len(res))
    ax.bar([x - 0.2 for x in xs], [r["ttft_p50_ms"] for r in res], 0.4, label="TTFT p50")
    ax.bar([x + 0.2 for x in xs], [r["ttft_p99_ms"] for r in res], 0.4, label="TTFT p99")
    for x, r in zip(xs, res, strict=True):
        ax.text(x + 0.2, r["ttft_p99_ms"] * 1.02,
                f"+{r['extra_calls_per_request']:.1%} calls\nsuccess {r['success']:.1%}",
                ha="center", fontsize=8)  # fmt: skip
    ax.set_xticks(list(xs), [r["label"] for r in res])
    ax.set_ylabel("ms")
    ax.set_title("p50 / p99 time to first token, and the extra upstream calls", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    if res:
        ax.legend(fontsize=8)
        ax.set_ylim(0, max(r["ttft_p99_ms"] for r in res) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "fake":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(fake_main(json.loads(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="120 requests, times scaled by 1/4")
    p.add_argument("--hedges", default="0,1000,2000", help="hedge_after_ms values (0 = off)")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=24)
    p.add_argument("--fast-s", type=float, default=0.3)
    p.add_argument("--tail-s", type=float, default=8.0)
    p.add_argument("--tail-share", type=float, default=0.05)
    p.add_argument("--events", type=int, default=8)
    p.add_argument("--gap-ms", type=float, default=20.0)
    p.add_argument("--scale", type=float, default=None, help="scale every time (default 1)")
    p.add_argument("--out", default=None, help="results file stem in benchmarks/results")
    p.add_argument("--report-only", action="store_true", help="rewrite STEM.md/png from STEM.json")
    args = p.parse_args()
    stem = args.out or ("hedging-quick" if args.quick else "hedging")
    if args.report_only:
        print(write_outputs(stem))
        return 0
    args.requests = args.requests or (120 if args.quick else 600)
    args.scale = args.scale or (0.25 if args.quick else 1.0)
    try:
        args.hedge_list = [int(h) for h in args.hedges.split(",") if h.strip()]
    except ValueError:
        p.error("--hedges: whole milliseconds, comma-separated")
    if not args.hedge_list or min(args.hedge_list) < 0:
        p.error("--hedges: one or more values >= 0")
    results = bl.run_scenarios("hedging", stem, args, {"hedging": run}, ["hedging"])
    print(write_outputs(stem))
    print(f"took {results['took_min']:.1f} min")
    return 0


def write_outputs(stem: str) -> str:
    """``STEM.md`` and ``STEM.png`` from ``STEM.json`` (a run's, or an earlier one's)."""
    return bl.scenario_outputs(stem, "hedging.png", report, chart)


if __name__ == "__main__":
    sys.exit(main())

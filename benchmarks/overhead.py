"""Relay overhead: the sidecar against a direct connection, a bare aiohttp relay and nginx.

    .venv/bin/python benchmarks/overhead.py [--quick]

One lean upstream (``benchmarks/upstream.py``) in its own process; in front of it,
each in its own process: the bare relay (``benchmarks/bare_relay.py``), nginx
(``proxy_buffering off``, one worker; installed from Debian when missing, skipped
with a note when it cannot be had) and the sidecar (``sidecar serve`` with a
breaker on both upstreams, two routes, metrics). The load generator is another
process: wrk (Lua script for the POST body) for the JSON workloads, and
``benchmarks/loadgen.py`` for the SSE workload (wrk cannot time first bytes).

Workloads: a ~500-byte JSON chat completion at concurrency 1, 32 and 64; an SSE
stream of 20 events (10 ms apart by default) at concurrency 64. Every repetition
runs every workload against every target, back to back (interleaved, the order
rotated per repetition); the report gives medians over the repetitions, and the
ratios are computed within each repetition (target / direct, target / nginx) before
taking their median, so a noisy neighbour slows the baseline and the target alike.
One exception: the c=1 latency bar (the targets table) is the **ratio of the
medians**, the sidecar's median added p50 (its p50 minus direct's, within each
repetition) over the bare relay's, the two numbers of the JSON table's ``p50 added
ms`` column. A median of per-repetition ratios of two small differences swings with
whichever repetition's bare relay happened to add little (one run: 0.90x against a
ratio of the medians of 1.4x); it is reported below the bar for reference only.

Writes ``benchmarks/results/overhead.{md,png,json}``.

``--access-log-off`` adds a second sidecar, identical but for ``server.access_log =
false`` (target ``sidecar, no access log``), and a section pricing the access log:
per workload, the median over repetitions of the on/off ratios within each one.

``--bounds`` adds a sidecar with everything of issue #24 configured (``hedge_after_ms``,
the retry budget, jitter, ``rate_limit_scope``: :func:`bounds_toml`) and a section
pricing them on the healthy path the same way.

``--tracing RATIO`` adds a sidecar identical but for a ``[tracing]`` table with
``sample_ratio = RATIO``, exporting to a no-op OTLP/HTTP receiver in its own process
(``benchmarks/otlp_sink.py``), and a section pricing tracing the same way (issue 25:
at ``--tracing 0`` the CPU per request within 3 % of the sidecar without tracing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl
from loadgen import DEFAULT_BODY

WORKLOADS = [
    ("json c=1", "json", 1),
    ("json c=32", "json", 32),
    ("json c=64", "json", 64),
    ("sse c=64", "sse", 64),
]
TARGETS = ["direct", "bare relay", "nginx", "sidecar"]
PATH = "/v1/chat/completions"

WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
wrk.body = [==[%s]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK {"requests":%%d,"duration_us":%%d,"p50_us":%%d,"p99_us":%%d,"max_us":%%d,' ..
    '"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end
"""

SIDECAR_TOML = """
[upstreams.primary]
base_url = "http://127.0.0.1:{up}"
[upstreams.primary.circuit_breaker]
failure_threshold = 3
cooldown_ms = 30000

[upstreams.backup]
base_url = "http://127.0.0.1:{up}"
[upstreams.backup.circuit_breaker]
failure_threshold = 3
cooldown_ms = 30000

[[routes]]
name = "anthropic"
path_prefix = "/v1/messages"
candidates = [{{ upstream = "backup" }}]

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary" }}, {{ upstream = "backup" }}]
"""

NGINX_CONF = """
daemon off;
master_process on;
worker_processes 1;
user root;
pid {wd}/nginx.pid;
error_log {wd}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {wd}/nginx-body;
  proxy_temp_path {wd}/nginx-proxy;
  fastcgi_temp_path {wd}/nginx-fastcgi;
  uwsgi_temp_path {wd}/nginx-uwsgi;
  scgi_temp_path {wd}/nginx-scgi;
  upstream llm {{
    server 127.0.0.1:{up};
    keepalive 256;
    keepalive_requests 1000000;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://llm;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


class Target:
    def __init__(self, name: str, port: int, pid: int | None, tree: bool = False) -> None:
        self.name, self.port, self.pid, self.tree = name, port, pid, tree
        self.idle_rss = float("nan")
        self.peak_rss = float("nan")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{PATH}"

    def cpu(self) -> float:
        return bl.cpu_seconds(self.pid, self.tree) if self.pid else 0.0


def run_wrk(wrk: str, lua: Path, url: str, conc: int, duration: float) -> dict[str, Any]:
    cmd = [
        wrk,
        "-t1",
        f"-c{conc}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "10s",
        "-s",
        str(lua),
        url,
    ]
    r = bl.run_json_tool(cmd, timeout=duration + 30, marker="WRK ")
    dur = r["duration_us"] / 1e6
    ok = r["requests"] - r["status"]
    return {
        "requests": ok,
        "errors": r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"],
        "rps": ok / dur,
        "p50_ms": r["p50_us"] / 1000,
        "p99_ms": r["p99_us"] / 1000,
        "client_cpu_util": float("nan"),
    }


def run_loadgen(url: str, conc: int, duration: float, stream: bool) -> dict[str, Any]:
    cmd = [bl.PY, str(bl.HERE / "loadgen.py"), "closed", "--url", url]
    cmd += ["--concurrency", str(conc), "--duration", str(duration), "--timeout", "10"]
    if stream:
        cmd.append("--stream")
    r = bl.run_json_tool(cmd, timeout=duration + 60, marker="RESULT ")
    r["errors"] = sum(r["errors"].values())
    return r


def measure(
    tgt: Target, upstream: bl.Proc, kind: str, conc: int, duration: float, ctx: dict[str, Any]
) -> dict[str, Any]:
    foreign = bl.ForeignCpu(lambda: tgt.cpu() + bl.cpu_seconds(upstream.pid))
    cpu0, up0, t0 = tgt.cpu(), bl.cpu_seconds(upstream.pid), time.monotonic()
    if kind == "json" and ctx["wrk"]:
        r = run_wrk(ctx["wrk"], ctx["lua"], tgt.url, conc, duration)
    else:
        r = run_loadgen(tgt.url, conc, duration, stream=kind == "sse")
    wall = time.monotonic() - t0
    cpu, up_cpu = tgt.cpu() - cpu0, bl.cpu_seconds(upstream.pid) - up0
    n = max(r["requests"], 1)
    r["proxy_cpu_s"] = cpu
    r["proxy_cpu_ms_per_req"] = cpu / n * 1000 if tgt.pid else float("nan")
    r["proxy_cpu_util"] = cpu / wall if tgt.pid else float("nan")
    r["upstream_cpu_util"] = up_cpu / wall
    r["foreign_cores"] = foreign.cores()
    if kind == "sse":
        chunks = r.get("events_total") or n * ctx["sse_chunks"]
        r["proxy_cpu_us_per_chunk"] = cpu / chunks * 1e6 if tgt.pid else float("nan")
    return r


def calibrate_upstreams(
    procs: bl.Procs, ctx: dict[str, Any], lean_port: int, lean: bl.Proc, duration: float
) -> dict[str, Any]:
    """Direct JSON c=64 against the package's FakeUpstream and the lean upstream."""
    out: dict[str, Any] = {}
    port = bl.free_port()
    fake = procs.start(
        "fake-upstream", [bl.PY, "-m", "sidecar.testing", "--port", str(port), "--quiet"]
    )
    bl.wait_port(port, fake)
    try:
        for name, p, proc in (("FakeUpstream", port, fake), ("lean", lean_port, lean)):
            r = measure(Target(name, p, None), proc, "json", 64, duration, ctx)
            out[name] = {"rps": r["rps"], "upstream_cpu_util": r["upstream_cpu_util"]}
    finally:
        procs.stop(fake)
    return out


NO_ACCESS_LOG = "sidecar, no access log"
TRACING = "sidecar, tracing"
"""``--tracing RATIO``: the same sidecar with ``[tracing]`` at that ``sample_ratio``."""
TRACING_TOML = """
[tracing]
otlp_endpoint = "http://127.0.0.1:{port}/v1/traces"
sample_ratio = {ratio}
"""
BOUNDS = "sidecar, bounds on"
"""``--bounds``: the same sidecar with everything of issue #24 configured
(:func:`bounds_toml`)."""
BOUNDS_RETRY = """
[upstreams.primary.retry]
budget_percent = 20
min_retry_concurrency = 3
jitter = true
[upstreams.backup.retry]
budget_percent = 20
min_retry_concurrency = 3
jitter = true
"""
"""``--bounds``: both upstreams' retry tables (the defaults, written out)."""


def bounds_toml(up_port: int) -> str:
    """:data:`SIDECAR_TOML` with everything of issue #24 configured: the chat route hedges
    after 2 s (never reached by a healthy upstream: the cost is the timer armed per
    request), both upstreams say ``rate_limit_scope = "credential"`` and carry
    :data:`BOUNDS_RETRY`' retry budget and jitter."""
    text = SIDECAR_TOML.format(up=up_port)
    ordered = 'candidates = [{ upstream = "primary" }, { upstream = "backup" }]'
    assert ordered in text
    text = text.replace(ordered, ordered + "\nhedge_after_ms = 2000")
    for up in ("primary", "backup"):
        table = f'[upstreams.{up}]\nbase_url = "http://127.0.0.1:{up_port}"\n'
        assert table in text
        text = text.replace(table, table + 'rate_limit_scope = "credential"\n')
    return BOUNDS_RETRY + text


def tier_toml(up_port: int) -> str:
    """:data:`SIDECAR_TOML` with the chat route's two candidates as one ``least_loaded``
    tier (``--tier``)."""
    text = SIDECAR_TOML.format(up=up_port)
    ordered = 'candidates = [{ upstream = "primary" }, { upstream = "backup" }]'
    assert ordered in text
    tiered = 'candidates = [{ upstream = "primary", tier = 0 }, { upstream = "backup", tier = 0 }]'
    return text.replace(ordered, tiered)


TIER = "sidecar, tier route"
"""``--tier``: the same sidecar with the chat route's two candidates as one
``least_loaded`` tier (issue #22: the chooser's cost against the ordered route)."""


def start_targets(
    procs: bl.Procs,
    wd: Path,
    up_port: int,
    nginx: str | None,
    floor: bool = False,
    access_log_off: bool = False,
    tier: bool = False,
    tracing: float | None = None,
    bounds: bool = False,
) -> tuple[list[Target], dict[str, Any]]:
    notes: dict[str, Any] = {}
    targets = [Target("direct", up_port, None)]
    bare_port = bl.free_port()
    cmd = [bl.PY, str(bl.HERE / "bare_relay.py"), "--port", str(bare_port)]
    bare = procs.start("bare-relay", [*cmd, "--upstream", f"http://127.0.0.1:{up_port}"])
    bl.wait_port(bare_port, bare)
    targets.append(Target("bare relay", bare_port, bare.pid))
    if nginx:
        port = bl.free_port()
        conf = wd / "nginx.conf"
        conf.write_text(NGINX_CONF.format(wd=wd, up=up_port, port=port))
        ng = procs.start("nginx", [nginx, "-p", str(wd), "-c", str(conf), "-e", "stderr"])
        try:
            bl.wait_port(port, ng)
            targets.append(Target("nginx", port, ng.pid, tree=True))
            notes["nginx"] = bl._version([nginx, "-v"])
        except (RuntimeError, TimeoutError) as exc:
            procs.stop(ng)
            notes["nginx"] = f"skipped: did not start ({exc})"
            print(f"note: nginx skipped: {exc}")
    else:
        notes["nginx"] = "skipped: not installed and could not be installed"
    if floor:
        port = bl.free_port()
        cmd = [bl.PY, str(bl.HERE / "floor_relay.py"), "--port", str(port)]
        fl = procs.start("floor-relay", [*cmd, "--upstream-port", str(up_port)])
        bl.wait_port(port, fl)
        targets.append(Target("floor relay", port, fl.pid))
    sc_port, admin = bl.free_port(), bl.free_port()
    config = bl.write_sidecar_config(
        wd / "sidecar.toml",
        SIDECAR_TOML.format(up=up_port),
        listen=sc_port,
        admin=admin,
        log_level="info",  # the default: everything on, as a user runs it (issue #11)
    )
    sc = bl.start_sidecar(procs, "sidecar", config)
    targets.append(Target("sidecar", sc_port, sc.pid))
    notes["sidecar_proc"] = sc
    notes["sidecar_config"] = config.read_text()
    if access_log_off:
        port, admin = bl.free_port(), bl.free_port()
        quiet = bl.write_sidecar_config(
            wd / "sidecar-no-access-log.toml",
            "access_log = false\n" + SIDECAR_TOML.format(up=up_port),
            listen=port,
            admin=admin,
            log_level="info",
        )
        off = bl.start_sidecar(procs, "sidecar-no-access-log", quiet)
        targets.append(Target(NO_ACCESS_LOG, port, off.pid))
        notes["sidecar_off_proc"] = off
    if tier:
        port, admin = bl.free_port(), bl.free_port()
        config = bl.write_sidecar_config(
            wd / "sidecar-tier.toml", tier_toml(up_port), listen=port, admin=admin, log_level="info"
        )
        tp = bl.start_sidecar(procs, "sidecar-tier", config)
        targets.append(Target(TIER, port, tp.pid))
        notes["sidecar_tier_proc"] = tp
    if tracing is not None:
        sink_port = bl.free_port()
        sink = procs.start(
            "otlp-sink", [bl.PY, str(bl.HERE / "otlp_sink.py"), "--port", str(sink_port)]
        )
        bl.wait_port(sink_port, sink)
        port, admin = bl.free_port(), bl.free_port()
        traced = SIDECAR_TOML.format(up=up_port) + TRACING_TOML.format(
            port=sink_port, ratio=float(tracing)
        )
        config = bl.write_sidecar_config(
            wd / "sidecar-tracing.toml", traced, listen=port, admin=admin, log_level="info"
        )
        tr = bl.start_sidecar(procs, "sidecar-tracing", config)
        targets.append(Target(TRACING, port, tr.pid))
        notes["sidecar_tracing_proc"] = tr
        notes["otlp_sink_port"] = sink_port
    if bounds:
        port, admin = bl.free_port(), bl.free_port()
        config = bl.write_sidecar_config(
            wd / "sidecar-bounds.toml",
            bounds_toml(up_port),
            listen=port,
            admin=admin,
            log_level="info",
        )
        bp = bl.start_sidecar(procs, "sidecar-bounds", config)
        targets.append(Target(BOUNDS, port, bp.pid))
        notes["sidecar_bounds_proc"] = bp
    return targets, notes


def access_log_rows(cells: list[dict[str, Any]], other: str = NO_ACCESS_LOG) -> list[list[Any]]:
    """Per workload: medians over repetitions of the sidecar against ``other`` (with its
    access log off, or the tier route: "on" is the sidecar, "off" the other), each
    ratio taken within one repetition (same minute, same neighbours)."""
    rows: list[list[Any]] = []
    for wl, _, _ in WORKLOADS:
        per_rep: dict[int, dict[str, dict[str, Any]]] = {}
        for c in cells:
            if c["workload"] == wl and c["target"] in ("sidecar", other):
                per_rep.setdefault(c["rep"], {})[c["target"]] = c
        pairs = [(r["sidecar"], r[other]) for r in per_rep.values() if len(r) == 2]
        if not pairs:
            continue
        cpu = [(on["proxy_cpu_ms_per_req"] * 1000, off["proxy_cpu_ms_per_req"] * 1000)
               for on, off in pairs]  # fmt: skip
        rows.append(
            [
                wl,
                f"{bl.median([a for a, _ in cpu]):.0f}",
                f"{bl.median([b for _, b in cpu]):.0f}",
                f"{bl.median([a - b for a, b in cpu]):+.1f}",
                f"{bl.median([a / b for a, b in cpu]):.3f}",
                f"{bl.median([a['rps'] / b['rps'] for a, b in pairs]):.3f}",
                f"{bl.median([a['p50_ms'] for a, _ in pairs]):.2f} / "
                f"{bl.median([b['p50_ms'] for _, b in pairs]):.2f}",
            ]
        )
    return rows


def summarise(cells: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Medians per (workload, target), and per-repetition ratios' medians."""
    out: dict[str, dict[str, Any]] = {}
    chunks = max((c.get("sse_chunks", 20) for c in cells), default=20)
    for wl, kind, _ in WORKLOADS:
        for name in names:
            mine = [c for c in cells if c["workload"] == wl and c["target"] == name]
            if not mine:
                continue
            s: dict[str, Any] = {"reps": len(mine)}
            keys = ["rps", "p50_ms", "p99_ms", "proxy_cpu_ms_per_req", "upstream_cpu_util"]
            keys += ["client_cpu_util", "errors", "proxy_cpu_util", "foreign_cores"]
            if kind == "sse":
                keys += ["ttfb_p50_ms", "ttfb_p99_ms", "proxy_cpu_us_per_chunk", "events_min"]
            for k in keys:
                s[k] = bl.median([float(c.get(k, float("nan"))) for c in mine])
            for base in ("direct", "nginx", "bare relay"):
                ratios: dict[str, list[float]] = {"rps": [], "p50": [], "added_p50": []}
                ratios["ttfb_added"] = []
                for c in mine:
                    b = [
                        x
                        for x in cells
                        if x["workload"] == wl and x["target"] == base and x["rep"] == c["rep"]
                    ]
                    if not b:
                        continue
                    ratios["rps"].append(c["rps"] / b[0]["rps"])
                    ratios["p50"].append(c["p50_ms"] / b[0]["p50_ms"])
                    ratios["added_p50"].append(c["p50_ms"] - b[0]["p50_ms"])
                    if kind == "sse":
                        ratios["ttfb_added"].append(c["ttfb_p50_ms"] - b[0]["ttfb_p50_ms"])
                key = base.replace(" ", "_")
                s[f"rps_x_{key}"] = bl.median(ratios["rps"])
                s[f"p50_x_{key}"] = bl.median(ratios["p50"])
                s[f"added_p50_ms_vs_{key}"] = bl.median(ratios["added_p50"])
                if kind == "sse":
                    s[f"ttfb_added_ms_vs_{key}"] = bl.median(ratios["ttfb_added"])
            out[f"{wl}|{name}"] = s
    for name in names:  # SSE: the streaming loop's own cost, without the request's
        sse, js = out.get(f"sse c=64|{name}"), out.get(f"json c=64|{name}")
        if sse and js:
            per_stream_us = sse["proxy_cpu_ms_per_req"] * 1000
            sse["proxy_cpu_us_per_chunk_marginal"] = (
                per_stream_us - js["proxy_cpu_ms_per_req"] * 1000
            ) / chunks
    return out


def added_latency_ratio(summary: dict[str, dict[str, Any]]) -> float:
    """The c=1 latency bar: the ratio of the medians, (median over repetitions of sidecar
    p50 - direct p50) / (median over repetitions of bare relay p50 - direct p50), each
    difference taken within one repetition: the two numbers of the JSON table's ``p50
    added ms`` column, divided (dimensionless; NaN when the bare relay added nothing)."""
    sc = summary.get("json c=1|sidecar", {}).get("added_p50_ms_vs_direct", float("nan"))
    bare = summary.get("json c=1|bare relay", {}).get("added_p50_ms_vs_direct", float("nan"))
    return sc / bare if bare == bare and bare > 0 else float("nan")


def added_latency_ratio_per_rep(cells: list[dict[str, Any]]) -> float:
    """For reference only, not the bar: the median over repetitions of (sidecar p50 -
    direct p50) / (bare p50 - direct p50) at c=1. A repetition whose bare relay added
    little makes a large ratio and one whose sidecar added little a small one, so this
    median can sit far from the ratio of the medians (0.90x against 1.4x in one run)."""
    vals = []
    for rep in {c["rep"] for c in cells}:
        got = {
            c["target"]: c["p50_ms"]
            for c in cells
            if c["workload"] == "json c=1" and c["rep"] == rep
        }
        if {"direct", "bare relay", "sidecar"} <= got.keys():
            bare_added = got["bare relay"] - got["direct"]
            if bare_added > 0:
                vals.append((got["sidecar"] - got["direct"]) / bare_added)
    return bl.median(vals)


def targets_table(summary: dict[str, dict[str, Any]], cells: list[dict[str, Any]]) -> list[Any]:
    """Issue #11's goals that this benchmark measures: (target, goal, measured, met).

    The bar is relative to the bare aiohttp relay of the same run; the ambition
    beyond it is absolute on this machine.
    """
    g = summary.get
    sc64, bare64 = g("json c=64|sidecar", {}), g("json c=64|bare relay", {})
    sse, bare_sse = g("sse c=64|sidecar", {}), g("sse c=64|bare relay", {})
    nan = float("nan")
    rows = []

    def row(what: str, goal: str, value: float, unit: str, ok: bool) -> None:
        shown = "-" if value != value else f"{value:.2f}{unit}"
        rows.append([what, goal, shown, "-" if value != value else ("yes" if ok else "**no**")])

    def over(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
        x, y = a.get(key, nan), b.get(key, nan)
        return x / y if y == y and y else nan

    x = sc64.get("rps_x_bare_relay", nan)
    row("bar: JSON throughput c=64, x bare relay", ">= 1.0x", x, "x", x >= 1.0)
    x = over(sc64, bare64, "proxy_cpu_ms_per_req")
    row("bar: CPU per JSON request c=64, x bare relay", "<= 1.0x", x, "x", x <= 1.0)
    ratio = added_latency_ratio(summary)
    row(
        "bar: added p50 latency at c=1, x bare relay's (ratio of the medians)",
        "<= 1.0x",
        ratio,
        "x",
        ratio <= 1.0,
    )
    x = added_latency_ratio_per_rep(cells)
    rows.append(
        [
            "(reference: the same, median of per-repetition ratios; not the bar)",
            "-",
            "-" if x != x else f"{x:.2f}x",
            "-",
        ]
    )
    x = over(sse, bare_sse, "proxy_cpu_us_per_chunk")
    row("bar: CPU per SSE chunk (all-in), x bare relay", "<= 1.0x", x, "x", x <= 1.0)
    cpu_us = sc64.get("proxy_cpu_ms_per_req", nan) * 1000
    row("ambition: CPU per JSON request (c=64)", "<= 100 us", cpu_us, " us", cpu_us <= 100)
    x = sse.get("proxy_cpu_us_per_chunk", nan)
    row("ambition: CPU per SSE chunk (all-in)", "<= 25 us", x, " us", x <= 25)
    x = over(sc64, bare64, "p99_ms")
    row("ambition: p99 at c=64, x bare relay's", "<= 2.0x", x, "x", x <= 2.0)
    x = sse.get("rps_x_direct", nan)
    row("SSE throughput c=64, x direct", ">= 0.90x", x, "x", x >= 0.9)
    x = sse.get("ttfb_added_ms_vs_direct", nan)
    row("added to first SSE event (p50)", "<= 1.5 ms", x, " ms", x <= 1.5)
    return rows


def chart(path: Path, summary: dict[str, dict[str, Any]], names: list[str]) -> bool:
    plt = bl.matplotlib_pyplot()
    if plt is None:
        return False
    wls = [w for w, _, _ in WORKLOADS]
    proxies = [n for n in names if n != "direct"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    width = 0.8 / max(len(proxies), 1)
    for i, name in enumerate(proxies):
        xs = [j + (i - (len(proxies) - 1) / 2) * width for j in range(len(wls))]
        rps = [summary.get(f"{w}|{name}", {}).get("rps_x_direct", 0) for w in wls]
        axes[0].bar(xs, rps, width, label=name)
        added = [
            summary.get(f"{w}|{name}", {}).get(
                "ttfb_added_ms_vs_direct" if w.startswith("sse") else "added_p50_ms_vs_direct", 0
            )
            for w in wls
        ]
        axes[1].bar(xs, [max(a, 0.01) for a in added], width, label=name)
        cpu = [
            summary.get(f"{w}|{name}", {}).get("proxy_cpu_ms_per_req", 0) * 1000 for w in wls[:3]
        ]
        axes[2].bar(xs[:3], cpu, width, label=name)
    axes[0].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].set_title("throughput / direct (higher is better)")
    axes[1].set_yscale("log")
    axes[1].set_title("added p50 latency vs direct, ms\n(SSE: added time to first event)")
    axes[2].set_title("proxy CPU per JSON request, us")
    for ax, labels in ((axes[0], wls), (axes[1], wls), (axes[2], wls[:3])):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Relay overhead (medians of interleaved repetitions)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _ms3(value: float) -> str:
    return "-" if value != value else f"{value:.3f}"


def report(
    args: argparse.Namespace,
    info: dict[str, str],
    notes: dict[str, Any],
    targets: list[Target],
    summary: dict[str, dict[str, Any]],
    cells: list[dict[str, Any]],
    calib: dict[str, Any],
    elapsed: float,
    command: str,
) -> str:
    names = [t.name for t in targets]
    has_nginx = "nginx" in names
    lines = [
        "# Relay overhead: sidecar vs direct, bare aiohttp relay and nginx",
        "",
        f"Command: `{command}` ({'quick' if args.quick else 'full'} run, "
        f"{args.reps} interleaved repetitions x {args.duration:g} s per cell, "
        f"took {elapsed / 60:.1f} min)",
        "",
        bl.machine_md(
            info,
            {
                "load generator": (
                    f"{notes.get('wrk', 'loadgen.py')} (JSON, 1 thread); "
                    "benchmarks/loadgen.py (SSE)"
                ),
                "nginx": notes.get("nginx", "-"),
            },
        ),
        "",
        "Every number is the median over the repetitions; `x direct` / `x nginx` are "
        "medians of per-repetition ratios (same repetition, back to back). This is a "
        "2-core machine shared with other work: load generator, upstream and proxy "
        "share the cores, so absolute numbers move between runs; the ratios and the "
        "CPU cost per request are the stable part. `other load`: cores used during the "
        "cell by processes outside this benchmark (median; a noise indicator).",
        "",
        "## JSON chat completion (~500-byte request, 545-byte response)",
        "",
    ]
    head = ["workload", "target", "req/s", "p50 ms", "p99 ms", "proxy CPU s/1k req"]
    head += ["proxy CPU us/req"]
    head += ["req/s x direct", "p50 added ms"]
    if has_nginx:
        head += ["req/s x nginx"]
    head += ["upstream CPU", "other load", "errors"]
    rows = []
    for wl, kind, _ in WORKLOADS:
        if kind != "json":
            continue
        for n in names:
            s = summary.get(f"{wl}|{n}")
            if not s:
                continue
            cpu_ms = s["proxy_cpu_ms_per_req"]
            row = [wl, n, s["rps"], s["p50_ms"], s["p99_ms"], _ms3(cpu_ms), cpu_ms * 1000]
            row += [s["rps_x_direct"], s["added_p50_ms_vs_direct"]]
            if has_nginx:
                row += [s.get("rps_x_nginx", float("nan"))]
            row += [f"{s['upstream_cpu_util']:.0%}", f"{s['foreign_cores']:.2f}", int(s["errors"])]
            rows.append(row)
    lines += [bl.md_table(head, rows), ""]
    lines += [
        f"## SSE stream ({args.sse_chunks} events, {args.sse_gap_ms:g} ms apart), concurrency 64",
        "",
    ]
    head = ["target", "streams/s", "TTFB p50 ms", "TTFB p99 ms", "total p50 ms", "total p99 ms"]
    head += ["proxy CPU s/1k streams", "proxy CPU us/chunk", "marginal us/chunk", "x direct"]
    head += ["TTFB added ms"]
    if has_nginx:
        head += ["x nginx"]
    head += ["client CPU", "other load", "errors"]
    rows = []
    for n in names:
        s = summary.get(f"sse c=64|{n}")
        if not s:
            continue
        row = [n, s["rps"], s["ttfb_p50_ms"], s["ttfb_p99_ms"], s["p50_ms"], s["p99_ms"]]
        row += [_ms3(s["proxy_cpu_ms_per_req"]), s["proxy_cpu_us_per_chunk"]]
        row += [s.get("proxy_cpu_us_per_chunk_marginal", float("nan"))]
        row += [s["rps_x_direct"], s["ttfb_added_ms_vs_direct"]]
        if has_nginx:
            row += [s.get("rps_x_nginx", float("nan"))]
        row += [f"{s['client_cpu_util']:.0%}", f"{s['foreign_cores']:.2f}", int(s["errors"])]
        rows.append(row)
    ideal = (args.sse_chunks - 1) * args.sse_gap_ms
    lines += [
        bl.md_table(head, rows),
        "",
        f"The upstream's own pacing makes a stream last at least {ideal:g} ms; "
        "`client CPU` is loadgen.py's CPU per wall second (1.0 = a saturated core). "
        "`proxy CPU us/chunk` is all-in (the proxy's CPU over the cell / events "
        "relayed, so the request's own cost is spread over its 20 events); "
        "`marginal us/chunk` estimates the streaming loop alone: (CPU per stream - "
        "CPU per JSON request at c=64) / 20.",
        "",
        "## Memory",
        "",
        bl.md_table(
            ["target", "RSS idle (after start) MiB", "peak RSS (VmHWM) MiB"],
            [[t.name, t.idle_rss, t.peak_rss] for t in targets if t.pid],
        ),
        "",
        "nginx: master + its one worker, summed.",
        "",
        f"![overhead]({args.out}.png)",
        "",
        "## Targets",
        "",
        bl.md_table(["target", "goal", "measured", "met"], targets_table(summary, cells)),
        "",
        "RSS targets: see `scale.md`.",
        "",
        "## Upstream check",
        "",
        "Direct JSON c=64 against each candidate upstream process, at the start of this run:",
        "",
        bl.md_table(
            ["upstream", "req/s", "its CPU (1.0 = one core)"],
            [[k, v["rps"], f"{v['upstream_cpu_util']:.0%}"] for k, v in calib.items()],
        ),
        "",
        "The package's FakeUpstream (parses and records every request, renders each "
        "answer) saturates its core at a fraction of the lean upstream's rate, so the "
        "benchmarks use `benchmarks/upstream.py`.",
        "",
        "## What ran",
        "",
        "- direct: the load generator to the upstream, no proxy.",
        "- bare relay: `benchmarks/bare_relay.py` (aiohttp server + one shared "
        "ClientSession: read body, forward, stream back; nothing else).",
        "- nginx: one worker, `proxy_buffering off`, upstream keepalive 256.",
        *(
            [
                "- floor relay: `benchmarks/floor_relay.py`, a protocol-level asyncio relay "
                "(no aiohttp objects; bytes passed through): a reference for what Python "
                "itself costs, not a product candidate."
            ]
            if "floor relay" in names
            else []
        ),
        "- sidecar: `sidecar serve`, the default log level (info), breakers on both upstreams, "
        "two routes (the chat route has a fallback candidate), metrics on, the access log on "
        "(its default). Config:",
        "",
        "```toml",
        notes.get("sidecar_config", "").strip(),
        "```",
    ]
    if NO_ACCESS_LOG in names:
        lines += [
            "- sidecar, no access log: the same config plus `access_log = false` in `[server]`.",
            "",
            "## The access log: on vs off",
            "",
            "Its stdout goes to a file, as a container runtime's log pipe would take it. "
            "`on/off` columns are medians over repetitions of the ratio within each "
            "repetition (the two sidecars run back to back in the same minute).",
            "",
            bl.md_table(
                [
                    "workload",
                    "CPU us/req on",
                    "CPU us/req off",
                    "added us/req",
                    "CPU on/off",
                    "req/s on/off",
                    "p50 ms on / off",
                ],
                access_log_rows(cells),
            ),
        ]
    if TRACING in names:
        lines += [
            "",
            f"## Tracing: off vs `[tracing]` at `sample_ratio = {args.tracing:g}`",
            "",
            f"`{TRACING}`: the same config plus `[tracing]` with `sample_ratio = "
            f"{args.tracing:g}`, exporting to `benchmarks/otlp_sink.py` (a no-op OTLP/HTTP "
            'receiver in its own process). Columns as above, "on" being the sidecar '
            "without tracing: `CPU on/off` below 1 means tracing costs more; the goal at "
            "`sample_ratio = 0` is at least 0.971 (tracing within 3 %). "
            f"Exports received: {notes.get('otlp_sink', '-')}.",
            "",
            bl.md_table(
                [
                    "workload",
                    "CPU us/req no tracing",
                    "CPU us/req tracing",
                    "no tracing - tracing us/req",
                    "CPU no tracing/tracing",
                    "req/s no tracing/tracing",
                    "p50 ms no tracing / tracing",
                ],
                access_log_rows(cells, TRACING),
            ),
        ]
    if BOUNDS in names:
        lines += [
            "",
            "## The bounds of issue #24: off vs all configured",
            "",
            f"`{BOUNDS}`: the same config with the chat route's `hedge_after_ms = 2000` "
            "(never reached here: the cost is the timer armed per request), both "
            'upstreams\' `rate_limit_scope = "credential"`, retry budget and full jitter '
            'written out. Columns as above, "on" being the sidecar without them: below 1, '
            "the bounds cost more.",
            "",
            bl.md_table(
                [
                    "workload",
                    "CPU us/req plain",
                    "CPU us/req bounds",
                    "plain - bounds us/req",
                    "CPU plain/bounds",
                    "req/s plain/bounds",
                    "p50 ms plain / bounds",
                ],
                access_log_rows(cells, BOUNDS),
            ),
        ]
    if TIER in names:
        lines += [
            "",
            "## The chooser: the ordered route vs a two-member tier",
            "",
            f"`{TIER}`: the same config with the chat route's candidates as "
            '`{ upstream = "primary", tier = 0 }, { upstream = "backup", tier = 0 }` '
            "(`least_loaded`). Columns as above: `ordered/tier` are medians over "
            "repetitions of the ratio within each repetition; below 1, the tier costs more.",
            "",
            bl.md_table(
                [
                    "workload",
                    "CPU us/req ordered",
                    "CPU us/req tier",
                    "ordered - tier us/req",
                    "CPU ordered/tier",
                    "req/s ordered/tier",
                    "p50 ms ordered / tier",
                ],
                access_log_rows(cells, TIER),
            ),
        ]
    return "\n".join(lines) + "\n"


def write_outputs(stem: str, data: dict[str, Any]) -> str:
    """Summarise ``data["cells"]``, write ``<stem>.md/.png/.json``; return the Markdown."""
    args = argparse.Namespace(**data["args"])
    targets = []
    for name, has_pid, tree in data["target_order"]:
        t = Target(name, 0, 1 if has_pid else None, tree)
        rss = data["rss"].get(name, {})
        t.idle_rss, t.peak_rss = rss.get("idle", float("nan")), rss.get("peak", float("nan"))
        targets.append(t)
    names = [t.name for t in targets]
    cells = data["cells"]
    summary = summarise(cells, names)
    data["summary"] = summary
    data["targets"] = targets_table(summary, cells)
    md = report(
        args,
        data["machine"],
        data["notes"],
        targets,
        summary,
        cells,
        data["calibration"],
        data["elapsed_s"],
        data["command"],
    )
    bl.RESULTS.mkdir(parents=True, exist_ok=True)
    (bl.RESULTS / f"{stem}.md").write_text(md)
    if not chart(bl.RESULTS / f"{stem}.png", summary, names):
        print("note: no chart (matplotlib unavailable)")
    bl.write_json(f"{stem}.json", data)
    return md


def report_only(stem: str) -> int:
    data = bl.read_json(f"{stem}.json")
    if not data or "target_order" not in data:
        print(f"no usable results/{stem}.json (run the benchmark first)")
        return 1
    write_outputs(stem, data)
    print(f"rewrote results/{stem}.md and .png from results/{stem}.json")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short cells (about 2 minutes in all)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (>= 3; full: 5)")
    p.add_argument("--duration", type=float, default=None, help="seconds per cell")
    p.add_argument("--sse-chunks", type=int, default=20)
    p.add_argument("--sse-gap-ms", type=float, default=10.0)
    p.add_argument("--no-nginx", action="store_true")
    p.add_argument(
        "--with-floor",
        action="store_true",
        help="add benchmarks/floor_relay.py (a protocol-level asyncio relay) as a target",
    )
    p.add_argument(
        "--access-log-off",
        action="store_true",
        help="add a second sidecar with server.access_log = false, to price the access log",
    )
    p.add_argument(
        "--tier",
        action="store_true",
        help="add a second sidecar whose chat route is a two-member tier, to price the chooser",
    )
    p.add_argument(
        "--tracing",
        type=float,
        default=None,
        metavar="RATIO",
        help="add a sidecar with [tracing] at this sample_ratio (0..1), exporting to a "
        "local no-op OTLP receiver, to price tracing",
    )
    p.add_argument(
        "--bounds",
        action="store_true",
        help="add a sidecar with everything of issue #24 configured (hedge_after_ms, "
        "retry budget, jitter, rate_limit_scope), to price them on the healthy path",
    )
    p.add_argument(
        "--workloads",
        type=lambda v: [w.strip() for w in v.split(",")],
        default=None,
        help='comma-separated subset, e.g. "json c=1" (default: all four)',
    )
    p.add_argument("--out", default=None, help="results file stem in benchmarks/results")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: rewrite the .md/.png from the .json of an earlier run",
    )
    args = p.parse_args()
    args.out = args.out or ("overhead-quick" if args.quick else "overhead") + (
        "-floor" if args.with_floor else ""
    )
    if args.report_only:
        return report_only(args.out)
    if args.tracing is not None and not 0.0 <= args.tracing <= 1.0:
        p.error("--tracing: a sample_ratio from 0 to 1")
    known = [w for w, _, _ in WORKLOADS]
    if args.workloads is not None and not set(args.workloads) <= set(known):
        p.error(f"--workloads: each one of {', '.join(known)}")
    if args.duration is None:
        args.duration = 1.0 if args.quick else 5.0
    args.reps = max(3, args.reps or (3 if args.quick else 5))
    started = time.monotonic()
    bl.raise_fd_limit()
    info = bl.machine()
    wrk = bl.apt_install("wrk", "wrk")
    if wrk is None:
        print("note: wrk unavailable; JSON workloads use loadgen.py (slower client)")
    nginx = None if args.no_nginx else bl.apt_install("nginx", "nginx")
    if nginx is None and not args.no_nginx:
        print("note: nginx unavailable; its rows are skipped")

    with bl.workdir("bench-overhead-") as wd, bl.Procs(wd) as procs:
        lua = wd / "post.lua"
        lua.write_text(WRK_LUA % DEFAULT_BODY.decode())
        ctx: dict[str, Any] = {"wrk": wrk, "lua": lua, "sse_chunks": args.sse_chunks}
        upstream, up_port = bl.start_upstream(
            procs,
            "upstream",
            "--sse-chunks",
            str(args.sse_chunks),
            "--sse-gap-ms",
            str(args.sse_gap_ms),
        )
        bl.progress("upstream check: FakeUpstream vs lean upstream, direct JSON c=64")
        calib = calibrate_upstreams(procs, ctx, up_port, upstream, 1.0 if args.quick else 2.0)
        for k, v in calib.items():
            print(f"  {k}: {v['rps']:.0f} req/s, upstream CPU {v['upstream_cpu_util']:.0%}")
        targets, notes = start_targets(
            procs, wd, up_port, nginx, args.with_floor, args.access_log_off, args.tier,
            args.tracing, args.bounds,
        )  # fmt: skip
        notes["wrk"] = bl._version([wrk, "--version"]) if wrk else "loadgen.py"
        time.sleep(0.5)
        for t in targets:
            if t.pid:
                t.idle_rss = bl.rss_mib(t.pid, t.tree)
        bl.progress("warm-up")
        for t in targets:
            measure(t, upstream, "json", 64, 1.0, ctx)
            if args.workloads is None or "sse c=64" in args.workloads:
                measure(t, upstream, "sse", 64, 1.0, ctx)
        cells: list[dict[str, Any]] = []
        workloads = [w for w in WORKLOADS if args.workloads is None or w[0] in args.workloads]
        total = args.reps * len(workloads) * len(targets)
        for rep in range(args.reps):
            for wl, kind, conc in workloads:
                k = rep % len(targets)
                for t in targets[k:] + targets[:k]:
                    r = measure(t, upstream, kind, conc, args.duration, ctx)
                    r.update(rep=rep, workload=wl, target=t.name, sse_chunks=args.sse_chunks)
                    cells.append(r)
                    bl.progress(
                        f"[{len(cells)}/{total}] rep {rep + 1} {wl:<9} {t.name:<10} "
                        f"{r['rps']:8.0f}/s p50 {r['p50_ms']:6.2f} ms p99 {r['p99_ms']:6.2f} ms"
                        + (f" cpu {r['proxy_cpu_ms_per_req'] * 1000:5.0f} us/req" if t.pid else "")
                    )
        for t in targets:
            if t.pid:
                t.peak_rss = bl.hwm_mib(t.pid, t.tree)
        notes["sidecar_exit"] = procs.stop(notes.pop("sidecar_proc"))
        if "sidecar_off_proc" in notes:
            notes["sidecar_off_exit"] = procs.stop(notes.pop("sidecar_off_proc"))
        if "sidecar_tier_proc" in notes:
            notes["sidecar_tier_exit"] = procs.stop(notes.pop("sidecar_tier_proc"))
        if "sidecar_tracing_proc" in notes:
            notes["sidecar_tracing_exit"] = procs.stop(notes.pop("sidecar_tracing_proc"))
            with contextlib.suppress(OSError, ValueError):
                stats = json.loads(bl.http_get(notes.pop("otlp_sink_port"), "/stats")[1])
                notes["otlp_sink"] = f"{stats['exports']} exports, {stats['bytes']} bytes"

    elapsed = time.monotonic() - started
    info["loadavg at end"] = bl.loadavg()
    data = {
        "command": bl.command_line(),
        "machine": info,
        "quick": args.quick,
        "args": {k: v for k, v in vars(args).items() if k != "report_only"},
        "notes": notes,
        "elapsed_s": elapsed,
        "target_order": [[t.name, bool(t.pid), t.tree] for t in targets],
        "cells": cells,
        "calibration": calib,
        "rss": {t.name: {"idle": t.idle_rss, "peak": t.peak_rss} for t in targets},
        "sidecar_exit": notes.get("sidecar_exit"),
    }
    md = write_outputs(args.out, data)
    print(md)
    print(f"wrote {bl.RESULTS / (args.out + '.md')} and .png/.json in {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

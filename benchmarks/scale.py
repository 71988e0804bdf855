"""Scale: 1,000 concurrent slow SSE streams through the sidecar, then a leak check.

    .venv/bin/python benchmarks/scale.py [--quick]

A lean upstream (``benchmarks/upstream.py``) streams 20 events 500 ms apart
(about 10 s per stream); ``benchmarks/loadgen.py streams`` (its own process)
opens 1,000 streams through the sidecar, one connection each, over 2 s.

Phase 1: every stream runs to its end. Phase 2: the same, but every second client
drops its connection (RST) after 3 events, so half the streams take the sidecar's
client-disconnect path. During each phase the sidecar's RSS, CPU, open file
descriptors and TCP sockets are sampled; after each, the script waits until the
fds are back at the idle baseline (the upstream keep-alive pool empties after
aiohttp's 15 s keep-alive timeout) and checks that the sidecar's TCP sockets are
only its two listeners again, the upstream holds no connection from it, and
``sidecar_inflight_requests`` is 0.

Writes ``benchmarks/results/scale.{md,png,json}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import benchlib as bl

CONFIG = """max_concurrent_requests = 2048

[upstreams.llm]
base_url = "http://127.0.0.1:{up}"
max_connections = 2048
[upstreams.llm.circuit_breaker]
failure_threshold = 3
cooldown_ms = 30000

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "llm" }}]
"""


LEAK_HEAD = ["phase", "fds idle -> after", "fds back after s", "sidecar TCP sockets after"]
LEAK_HEAD += ["in flight", "upstream conns open", "RSS after MiB", "clean"]


class Sampler(threading.Thread):
    """Samples the sidecar every ``every`` seconds: RSS, CPU, fds, TCP sockets."""

    def __init__(self, pid: int, t0: float, every: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pid, self.t0, self.every = pid, t0, every
        self.samples: list[dict[str, Any]] = []
        self.phase = ""
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                tcp = bl.tcp_states(self.pid)
                self.samples.append(
                    {
                        "t": time.monotonic() - self.t0,
                        "phase": self.phase,
                        "rss": bl.rss_mib(self.pid),
                        "cpu": bl.cpu_seconds(self.pid),
                        "fds": bl.fd_count(self.pid),
                        "established": tcp.get("ESTABLISHED", 0),
                    }
                )
            except OSError:
                return
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def snapshot(pid: int, admin: int, upstream: bl.Proc) -> dict[str, Any]:
    return {
        "fds": bl.fd_count(pid),
        "tcp": bl.tcp_states(pid),
        "rss": bl.rss_mib(pid),
        "inflight": bl.metric_sum(admin, "sidecar_inflight_requests"),
        "upstream_open": bl.upstream_stats(upstream)["open"],
    }


def run_phase(
    name: str,
    args: argparse.Namespace,
    url: str,
    pid: int,
    admin: int,
    upstream: bl.Proc,
    sampler: Sampler,
    baseline: dict[str, Any],
    abort_every: int,
) -> dict[str, Any]:
    sampler.phase = name
    cpu0, t0 = bl.cpu_seconds(pid), time.monotonic()
    cmd = [bl.PY, str(bl.HERE / "loadgen.py"), "streams", "--url", url]
    cmd += ["--streams", str(args.streams), "--ramp", str(args.ramp), "--timeout", "60"]
    if abort_every:
        cmd += ["--abort-every", str(abort_every), "--abort-after", "3"]
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=bl.ROOT)
    plateau: dict[str, Any] = {}
    result: dict[str, Any] = {}
    try:
        assert gen.stdout is not None
        for line in gen.stdout:
            if line.startswith("RAMPED"):
                time.sleep(1.0)  # every stream open and streaming
                tcp = bl.tcp_states(pid)
                plateau = {
                    "t": time.monotonic() - t0,
                    "rss": bl.rss_mib(pid),
                    "fds": bl.fd_count(pid),
                    "established": tcp.get("ESTABLISHED", 0),
                    "inflight": bl.metric_sum(admin, "sidecar_inflight_requests"),
                    "upstream_streams": bl.upstream_stats(upstream)["streams"],
                }
                bl.progress(
                    f"  {name}: plateau RSS {plateau['rss']:.1f} MiB, fds {plateau['fds']}, "
                    f"in flight {plateau['inflight']:.0f}"
                )
            elif line.startswith("RESULT "):
                result = json.loads(line[7:])
        gen.wait(timeout=120)
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()
    busy_wall = time.monotonic() - t0
    cpu = bl.cpu_seconds(pid) - cpu0
    # Leak check: wait for the fds to come back to the idle baseline.
    sampler.phase = name + " drain"
    t_end = time.monotonic()
    back_after = float("nan")
    while time.monotonic() - t_end < args.drain_wait:
        if bl.fd_count(pid) <= baseline["fds"]:
            back_after = time.monotonic() - t_end
            break
        time.sleep(0.25)
    time.sleep(0.5)
    after = snapshot(pid, admin, upstream)
    events = result.get("completed", 0) * args.chunks + result.get("aborted", 0) * 3
    return {
        "phase": name,
        "loadgen": result,
        "plateau": plateau,
        "cpu_s": cpu,
        "busy_wall_s": busy_wall,
        "cpu_us_per_event": cpu / events * 1e6 if events else float("nan"),
        "fds_back_after_s": back_after,
        "after": after,
        "clean": (
            after["fds"] <= baseline["fds"]
            and after["tcp"] == baseline["tcp"]
            and after["inflight"] == 0
            and after["upstream_open"] == 0
        ),
    }


def chart(path: Path, samples: list[dict[str, Any]], baseline: dict[str, Any]) -> bool:
    plt = bl.matplotlib_pyplot()
    if plt is None or not samples:
        return False
    t = [s["t"] for s in samples]
    cpu = [0.0] + [
        (b["cpu"] - a["cpu"]) / max(b["t"] - a["t"], 1e-6) * 100
        for a, b in itertools.pairwise(samples)
    ]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    axes[0].plot(t, [s["rss"] for s in samples], color="tab:blue")
    axes[0].set_ylabel("RSS, MiB")
    axes[0].axhline(250, color="tab:red", ls="--", lw=0.8, label="target 250 MiB")
    axes[0].legend(fontsize=8)
    axes[1].plot(t, [s["fds"] for s in samples], label="open fds")
    axes[1].plot(t, [s["established"] for s in samples], label="ESTABLISHED TCP sockets")
    axes[1].axhline(baseline["fds"], color="grey", ls=":", lw=0.8, label="idle fds")
    axes[1].legend(fontsize=8)
    axes[1].set_ylabel("count")
    axes[2].plot(t, cpu, color="tab:orange")
    axes[2].set_ylabel("CPU, % of a core")
    axes[2].set_xlabel("seconds")
    starts: dict[str, float] = {}
    for s in samples:
        starts.setdefault(s["phase"], s["t"])
    for ax in axes:
        ax.grid(alpha=0.3)
        for ph, x in starts.items():
            if ph:
                ax.axvline(x, color="grey", lw=0.6)
    for ph, x in starts.items():
        if ph:
            axes[0].text(x, axes[0].get_ylim()[1] * 0.95, " " + ph, fontsize=7, va="top")
    fig.suptitle("Sidecar under 1,000 concurrent slow SSE streams, then drained")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def report(
    args: argparse.Namespace,
    info: dict[str, str],
    baseline: dict[str, Any],
    phases: list[dict[str, Any]],
    peak_rss: float,
    exit_code: int | None,
) -> str:
    rows = []
    for ph in phases:
        lg, pl = ph["loadgen"], ph["plateau"]
        rows.append(
            [
                ph["phase"],
                lg.get("completed", 0),
                lg.get("aborted", 0),
                sum(lg.get("errors", {}).values()),
                pl.get("rss", float("nan")),
                (pl.get("rss", float("nan")) - baseline["rss"]) * 1024 / args.streams,
                pl.get("fds", "-"),
                ph["cpu_s"],
                ph["cpu_us_per_event"],
                lg.get("ttfb_p99_ms", float("nan")),
            ]
        )
    leak_rows = []
    for ph in phases:
        a = ph["after"]
        leak_rows.append(
            [
                ph["phase"],
                f"{baseline['fds']} -> {a['fds']}",
                ph["fds_back_after_s"],
                ", ".join(f"{k} {v}" for k, v in sorted(a["tcp"].items())),
                int(a["inflight"]),
                a["upstream_open"],
                a["rss"],
                "yes" if ph["clean"] else "**no**",
            ]
        )
    head = ["phase", "completed", "aborted", "errors", f"RSS MiB ({args.streams:,} streams)"]
    head += ["KiB per stream", "fds", "CPU s", "CPU us per event", "TTFB p99 ms"]
    lines = [
        "# Scale: 1,000 concurrent slow SSE streams",
        "",
        f"Command: `{bl.command_line()}`",
        "",
        bl.machine_md(info),
        "",
        f"{args.streams} streams, one client connection each, opened over {args.ramp:g} s; "
        f"each stream is {args.chunks} events {args.gap_ms:g} ms apart "
        f"(~{(args.chunks - 1) * args.gap_ms / 1000:g} s).",
        "",
        bl.md_table(
            ["idle RSS MiB", "peak RSS (VmHWM) MiB", "idle fds", "idle TCP sockets", "exit"],
            [
                [
                    baseline["rss"],
                    peak_rss,
                    baseline["fds"],
                    ", ".join(f"{k} {v}" for k, v in sorted(baseline["tcp"].items())),
                    exit_code,
                ]
            ],
        ),
        "",
        "## Under load",
        "",
        bl.md_table(head, rows),
        "",
        "RSS and fds are read 1 s after every stream has received its first event. "
        "`CPU us per event` = sidecar CPU seconds over the phase / SSE events relayed.",
        "",
        "## Leak check (after each phase)",
        "",
        bl.md_table(
            LEAK_HEAD,
            leak_rows,
        ),
        "",
        "`fds back after`: seconds from the last stream's end until the sidecar's fd count "
        "was at its idle baseline again (idle pooled upstream connections close after "
        "aiohttp's 15 s keep-alive timeout). `clean`: fds at baseline, only the two "
        "listening sockets left, `sidecar_inflight_requests` 0, and the upstream holds "
        "no connection. `RSS after`: Python keeps freed memory in its allocator, so RSS "
        "does not fall back to idle; a leak would show as growth from one phase to the next.",
        "",
        "## Targets",
        "",
        bl.md_table(
            ["target", "goal", "measured", "met"],
            [
                [
                    "RSS idle",
                    "<= 60 MiB",
                    f"{baseline['rss']:.1f} MiB",
                    "yes" if baseline["rss"] <= 60 else "**no**",
                ],
                [
                    "RSS with 1,000 streams (peak)",
                    "<= 250 MiB",
                    f"{peak_rss:.1f} MiB",
                    "yes" if peak_rss <= 250 else "**no**",
                ],
            ],
        ),
        "",
        "Sidecar config (`max_connections` raised from its default 256: with 256, streams "
        "past the 256th wait for a pooled upstream connection):",
        "",
        "```toml",
        CONFIG.format(up="<upstream port>").strip(),
        "```",
        "",
        "![scale](scale.png)",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="200 streams, shorter streams")
    p.add_argument("--streams", type=int, default=None)
    p.add_argument("--ramp", type=float, default=2.0)
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--gap-ms", type=float, default=None)
    p.add_argument("--drain-wait", type=float, default=40.0, help="max seconds for fds to return")
    args = p.parse_args()
    args.streams = args.streams or (200 if args.quick else 1000)
    args.gap_ms = args.gap_ms if args.gap_ms is not None else (200.0 if args.quick else 500.0)
    bl.raise_fd_limit()
    info = bl.machine()
    started = time.monotonic()
    with bl.workdir("bench-scale-") as wd, bl.Procs(wd) as procs:
        upstream, up_port = bl.start_upstream(
            procs, "upstream", "--sse-chunks", str(args.chunks), "--sse-gap-ms", str(args.gap_ms)
        )
        listen, admin = bl.free_port(), bl.free_port()
        config = bl.write_sidecar_config(
            wd / "sidecar.toml", CONFIG.format(up=up_port), listen=listen, admin=admin
        )
        sc = bl.start_sidecar(procs, "sidecar", config)
        time.sleep(1.0)
        baseline = snapshot(sc.pid, admin, upstream)
        bl.progress(f"idle: RSS {baseline['rss']:.1f} MiB, fds {baseline['fds']}")
        sampler = Sampler(sc.pid, time.monotonic())
        sampler.start()
        url = f"http://127.0.0.1:{listen}/v1/chat/completions"
        phases = []
        try:
            for name, abort_every in (("complete", 0), ("half aborted", 2)):
                bl.progress(f"phase {name}: {args.streams} streams")
                ph = run_phase(
                    name, args, url, sc.pid, admin, upstream, sampler, baseline, abort_every
                )
                phases.append(ph)
                bl.progress(
                    f"  done: {ph['loadgen'].get('completed')} completed, "
                    f"{ph['loadgen'].get('aborted')} aborted, errors "
                    f"{ph['loadgen'].get('errors')}; fds back after {ph['fds_back_after_s']:.1f}"
                    f" s; clean {ph['clean']}"
                )
        finally:
            sampler.stop()
        peak_rss = bl.hwm_mib(sc.pid)
        exit_code = procs.stop(sc)
    md = report(args, info, baseline, phases, peak_rss, exit_code)
    bl.RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "scale-quick" if args.quick else "scale"
    (bl.RESULTS / f"{stem}.md").write_text(md.replace("(scale.png)", f"({stem}.png)"))
    if not chart(bl.RESULTS / f"{stem}.png", sampler.samples, baseline):
        print("note: no chart (matplotlib unavailable)")
    bl.write_json(
        f"{stem}.json",
        {
            "command": bl.command_line(),
            "machine": info,
            "args": vars(args),
            "baseline": baseline,
            "phases": phases,
            "peak_rss": peak_rss,
            "sidecar_exit": exit_code,
            "samples": sampler.samples,
        },
    )
    print(md)
    print(f"took {(time.monotonic() - started) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

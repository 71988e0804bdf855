"""The fleet: 1, 4 and 8 sidecar processes sharing one Redis, through a primary outage.

    .venv/bin/python benchmarks/fleet.py [--quick]

One private ``redis-server`` on a free loopback port, two lean upstreams
(``benchmarks/upstream.py``: the primary and a healthy fallback), N sidecars (route:
primary, then fallback; breaker on), and one ``benchmarks/loadgen.py open`` sending a
fixed total rate spread over the N sidecars at random, seeded (open loop, so fleet off and on
get the same offered traffic). Each scenario: healthy warm-up, the primary answering
503 for a while, then healthy again; each runs with the ``[fleet]`` table absent
("off": every sidecar learns alone) and present ("on"). Reported: the calls that
reached the failing primary (what its process read during the outage), the client's
p50/p99 during the outage, and the time from the recovery until every sidecar serves
from the primary again.

Then the fleet's cost on a healthy request path: 4 sidecars at a fixed rate, fleet
off and on (Redis healthy) interleaved, CPU seconds of the sidecar processes per
request, and Redis's own CPU.

Loopback only; process counts and rates are kept modest for a 2-core machine.
Writes ``benchmarks/results/fleet.{md,png,json}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl

CONFIG = """request_timeout_ms = 30000

[upstreams.primary]
base_url = "http://127.0.0.1:{primary}"
connect_timeout_ms = 1000
first_byte_timeout_ms = 2000

[upstreams.primary.circuit_breaker]
failure_threshold = 3
cooldown_ms = {cooldown_ms}

[upstreams.fallback]
base_url = "http://127.0.0.1:{fallback}"

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary" }}, {{ upstream = "fallback" }}]
{fleet}"""

FLEET = """
[fleet]
redis_url_env = "SIDECAR_REDIS_URL"
key_prefix = "{prefix}"
sync_interval_ms = {sync_ms}
open_quorum = 1
"""


def start_redis(procs: bl.Procs) -> tuple[bl.Proc, int]:
    exe = bl.apt_install("redis-server", "redis-server")
    if exe is None:
        raise SystemExit("redis-server is needed (apt-get install redis-server)")
    port = bl.free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = procs.start("redis", cmd)
    bl.wait_port(port, proc)
    return proc, port


def start_fleet(
    procs: bl.Procs, wd: Path, name: str, n: int, body: str, redis_port: int
) -> list[tuple[bl.Proc, int, int]]:
    """N sidecars with the same config; returns (proc, proxy port, admin port) once all ready."""
    out = []
    for i in range(n):
        listen, admin = bl.free_port(), bl.free_port()
        cfg = bl.write_sidecar_config(wd / f"{name}-{i}.toml", body, listen=listen, admin=admin)
        env = {"SIDECAR_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0", "HOSTNAME": f"bench-{i}"}
        cmd = [str(bl.VENV_BIN / "sidecar"), "serve", "--config", str(cfg)]
        out.append((procs.start(f"sidecar-{name}-{i}", cmd, env=env), listen, admin))
    deadline = time.monotonic() + 60
    for proc, _, admin in out:
        while True:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited early; see {proc.log}")
            try:
                if bl.http_get(admin, "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} not ready")
            time.sleep(0.05)
    return out


def loadgen(ports: list[int], rate: float, duration: float, out: Path) -> subprocess.Popen[str]:
    urls = [f"http://127.0.0.1:{p}/v1/chat/completions" for p in ports]
    cmd = [bl.PY, str(bl.HERE / "loadgen.py"), "open", "--url", urls[0]]
    for u in urls[1:]:
        cmd += ["--also-url", u]
    cmd += ["--rate", str(rate), "--duration", str(duration), "--out", str(out), "--timeout", "30"]
    cmd += ["--spread", "random", "--seed", "7"]  # each sidecar's share varies, as in a real fleet
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=bl.ROOT)


def run_outage(
    procs: bl.Procs,
    wd: Path,
    args: argparse.Namespace,
    primary: bl.Proc,
    ports: tuple[int, int, int],
    n: int,
    fleet: bool,
) -> dict[str, Any]:
    name = f"outage-{n}-{'on' if fleet else 'off'}"
    p_port, f_port, r_port = ports
    table = FLEET.format(prefix=f"{name}:", sync_ms=args.sync_ms) if fleet else ""
    body = CONFIG.format(primary=p_port, fallback=f_port, cooldown_ms=args.cooldown_ms, fleet=table)
    scs = start_fleet(procs, wd, name, n, body, r_port)
    out = wd / f"{name}.jsonl"
    gen = loadgen([s[1] for s in scs], args.rate, args.warm + args.outage + args.recovery, out)
    try:
        time.sleep(args.warm)
        before = bl.upstream_stats(primary)
        t_fail = json.loads(primary.send("mode 503"))["at"]
        time.sleep(args.outage)
        t_ok = json.loads(primary.send("mode ok"))["at"]
        during = bl.upstream_stats(primary)
        gen.communicate(timeout=args.recovery + 60)
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()
    for proc, _, _ in scs:
        procs.stop(proc)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    in_outage = [r for r in recs if t_fail <= r["t"] < t_ok]
    lat = sorted(r["latency"] for r in in_outage)
    ok = [r for r in in_outage if r["status"] == 200 and not r["error"]]
    back = []
    for i in range(n):
        after = [r for r in recs if r["t"] >= t_ok and r.get("target", 0) == i]
        not_primary = [r for r in after if r["upstream"] != "primary"]
        if not_primary and not_primary[-1] is after[-1]:
            back.append(float("nan"))  # never back within the window
        else:
            back.append(max((r["t"] + r["latency"] for r in not_primary), default=t_ok) - t_ok)
    return {
        "scenario": name,
        "sidecars": n,
        "fleet": fleet,
        "requests": len(in_outage),
        "primary_calls": during["requests"] - before["requests"],
        "primary_calls_per_sidecar": (during["requests"] - before["requests"]) / n,
        "p50_ms": bl.percentile(lat, 50) * 1000,
        "p99_ms": bl.percentile(lat, 99) * 1000,
        "slow": sum(1 for x in lat if x > 0.1),
        "success": len(ok) / max(len(in_outage), 1),
        "recovery_all_s": max(back),
        "recovery_each_s": back,
        "records": [
            [round(r["t"] - t_fail, 4), round(r["latency"], 4), r["upstream"]] for r in recs
        ],
        "t_ok": t_ok - t_fail,
    }


def run_cpu(
    procs: bl.Procs,
    wd: Path,
    args: argparse.Namespace,
    ports: tuple[int, int, int],
    redis: bl.Proc,
    fleet: bool,
    rep: int,
) -> dict[str, Any]:
    """CPU of the sidecars idle (the background sync alone), then under steady traffic."""
    name = f"cpu-{rep}-{'on' if fleet else 'off'}"
    p_port, f_port, r_port = ports
    table = FLEET.format(prefix=f"{name}:", sync_ms=args.cpu_sync_ms) if fleet else ""
    body = CONFIG.format(primary=p_port, fallback=f_port, cooldown_ms=args.cooldown_ms, fleet=table)
    scs = start_fleet(procs, wd, name, args.cpu_sidecars, body, r_port)

    def cpu() -> float:
        return sum(bl.cpu_seconds(p.pid) for p, _, _ in scs)

    time.sleep(1.0)  # start-up work done, first syncs made
    idle0, t_idle = cpu(), time.monotonic()
    time.sleep(args.cpu_idle_seconds)
    idle_rate = (cpu() - idle0) / (time.monotonic() - t_idle)  # CPU s per s, all sidecars
    out = wd / f"{name}.jsonl"
    gen = loadgen([s[1] for s in scs], args.cpu_rate, args.cpu_seconds + 1.0, out)
    time.sleep(1.0)  # connections open
    cpu0, redis0, t0 = cpu(), bl.cpu_seconds(redis.pid), time.monotonic()
    time.sleep(args.cpu_seconds)
    cpu1, redis1 = cpu(), bl.cpu_seconds(redis.pid)
    wall = time.monotonic() - t0
    gen.communicate(timeout=60)
    for proc, _, _ in scs:
        procs.stop(proc)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    window = [r for r in recs if t0 <= r["t"] < t0 + wall]  # loadgen's t: the same clock
    n = max(len(window), 1)
    return {
        "fleet": fleet,
        "rep": rep,
        "requests": len(window),
        "idle_cpu_ms_per_s": idle_rate * 1000 / len(scs),
        "cpu_us_per_request": (cpu1 - cpu0) / n * 1e6,
        "request_path_us": (cpu1 - cpu0 - idle_rate * wall) / n * 1e6,
        "redis_cpu_ms_per_s": (redis1 - redis0) / wall * 1000,
        "errors": sum(1 for r in window if r["status"] != 200 or r["error"]),
    }


def chart(path: Path, results: list[dict[str, Any]], sizes: list[int]) -> bool:
    plt = bl.matplotlib_pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.38
    for k, (key, label) in enumerate(
        [
            ("primary_calls", "calls that reached the failing primary"),
            ("slow", "client requests over 100 ms during the outage"),
            ("recovery_all_s", "recovery until every sidecar is back, s"),
        ]
    ):
        ax = axes[k]
        for j, fleet in enumerate((False, True)):
            vals = [
                next(r[key] for r in results if r["sidecars"] == n and r["fleet"] is fleet)
                for n in sizes
            ]
            xs = [i + (j - 0.5) * width for i in range(len(sizes))]
            bars = ax.bar(xs, vals, width, label="fleet on" if fleet else "fleet off")
            ax.bar_label(bars, fmt="%.0f" if key != "recovery_all_s" else "%.1f", fontsize=8)
        ax.set_xticks(range(len(sizes)), [f"{n} sidecar{'s' if n > 1 else ''}" for n in sizes])
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("A primary outage across a fleet of sidecars: fleet off vs on", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def report(
    args: argparse.Namespace, info: dict[str, str], results: list[dict[str, Any]], cpu: list[Any]
) -> str:
    rows = [
        [
            r["sidecars"],
            "on" if r["fleet"] else "off",
            r["requests"],
            int(r["primary_calls"]),
            r["primary_calls_per_sidecar"],
            r["p50_ms"],
            r["p99_ms"],
            r["slow"],
            f"{r['success']:.1%}",
            r["recovery_all_s"],
        ]
        for r in results
    ]
    head = ["sidecars", "fleet", "requests", "calls to primary", "per sidecar", "p50 ms"]
    head += ["p99 ms", "slow > 100 ms", "success", "recovery: all back s"]
    off = [c["cpu_us_per_request"] for c in cpu if not c["fleet"]]
    on = [c["cpu_us_per_request"] for c in cpu if c["fleet"]]
    cpu_rows = [
        [c["rep"], "on" if c["fleet"] else "off", c["requests"], c["idle_cpu_ms_per_s"],
         c["cpu_us_per_request"], c["request_path_us"], c["redis_cpu_ms_per_s"], c["errors"]]
        for c in cpu
    ]  # fmt: skip
    ratio = bl.median(on) / bl.median(off) if off and on else float("nan")
    path_off = [c["request_path_us"] for c in cpu if not c["fleet"]]
    path_on = [c["request_path_us"] for c in cpu if c["fleet"]]
    path_ratio = bl.median(path_on) / bl.median(path_off) if path_off else float("nan")
    spread = (max(off) - min(off)) / bl.median(off) if off else float("nan")
    sample = CONFIG.format(
        primary="P",
        fallback="F",
        cooldown_ms=args.cooldown_ms,
        fleet=FLEET.format(prefix="<run>:", sync_ms=args.sync_ms),
    )
    lines = [
        "# The fleet: breakers shared through Redis, fleet off vs on",
        "",
        f"Command: `{bl.command_line()}`",
        "",
        bl.machine_md(info),
        "",
        f"Open-loop traffic at {args.rate:g} JSON requests/s in total, each request sent to "
        f"a sidecar picked at random (seeded): {args.warm:g} s healthy, {args.outage:g} s of "
        f"primary outage (503), {args.recovery:g} s after recovery. Latency, success and "
        "calls count the requests sent during the outage.",
        "",
        bl.md_table(head, rows),
        "",
        "- **calls to primary**: requests the primary's process read during the outage "
        "(each sidecar call is 1 + 2 retries before it counts once for the breaker; "
        "probes included).",
        "- **slow > 100 ms**: client requests of the outage that took longer than 100 ms "
        "(they met the failing primary, its retries and backoff, before the fallback).",
        "- **recovery: all back**: from the primary's recovery until the last answer "
        "that any sidecar relayed from the fallback ended; after that every answer of "
        "every sidecar came from the primary.",
        "",
        "Where the difference comes from: with the fleet off, every sidecar pays its own "
        "opening (3 failing calls of 3 attempts each, plus the calls already in flight) "
        "and sends its own probe every cooldown, so the calls grow with N; with it on, "
        "the first sidecar to open stops the others (their calls between retries stop "
        "retrying too) and one probe per cooldown is sent for all. The p99 is the few "
        "requests already in flight when the outage began (their 1 + 2 attempts with "
        "250/500 ms backoff), the same either way; the recovery time depends on where in "
        "its cooldown the outage ended, for one sidecar or for the fleet.",
        "",
        f"## Cost on a healthy request path ({args.cpu_sidecars} sidecars, "
        f"{args.cpu_rate:g} requests/s, {args.cpu_seconds:g} s per run, interleaved; "
        f"`sync_interval_ms = {args.cpu_sync_ms}`, the default)",
        "",
        bl.md_table(
            [
                "run",
                "fleet",
                "requests",
                "idle CPU ms/s per sidecar",
                "CPU us/request",
                "request path us/request",
                "Redis CPU ms/s",
                "errors",
            ],
            cpu_rows,
        ),
        "",
        f"Median CPU per request, fleet on / off: **{ratio:.2f}x**; on the request path "
        f"alone (CPU under traffic minus the idle rate, which is the background sync): "
        f"**{path_ratio:.2f}x**. Run-to-run spread of the off runs: "
        f"{spread:.0%} (max - min over the median; a 2-core machine shared with other work).",
        "",
        "- **idle CPU**: the sidecar with no traffic, per process (the fleet's background "
        "sync, the config watcher, timers).",
        "- **request path**: CPU under traffic minus the idle rate over the same time, per "
        "request served.",
        "",
        "Sidecar config (fleet on; off = without the [fleet] table; each run its own key_prefix):",
        "",
        *bl.sidecar_config_md(sample),
        "",
        "![fleet](fleet.png)",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 and 4 sidecars, shorter phases")
    p.add_argument("--rate", type=float, default=24.0, help="total requests per second")
    p.add_argument("--warm", type=float, default=2.0)
    p.add_argument("--outage", type=float, default=9.0)
    p.add_argument("--recovery", type=float, default=5.0)
    p.add_argument("--cooldown-ms", type=int, default=1500)
    p.add_argument("--sync-ms", type=int, default=250)
    p.add_argument("--sizes", default="1,4,8")
    p.add_argument("--cpu-sidecars", type=int, default=4)
    p.add_argument("--cpu-rate", type=float, default=150.0)
    p.add_argument("--cpu-seconds", type=float, default=8.0)
    p.add_argument("--cpu-reps", type=int, default=3)
    p.add_argument("--cpu-idle-seconds", type=float, default=4.0)
    p.add_argument("--cpu-sync-ms", type=int, default=1000)
    p.add_argument("--report-only", action="store_true", help="redo .md/.png from the .json")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.outage, args.cpu_reps = "1,4", 5.0, 1
    sizes = [int(x) for x in args.sizes.split(",")]
    stem = "fleet-quick" if args.quick else "fleet"
    if args.report_only:
        data = bl.read_json(f"{stem}.json")
        saved = argparse.Namespace(**{**data["args"], "report_only": True})
        write_results(stem, saved, data["machine"], data["results"], data["cpu"], sizes, data)
        return 0
    info = bl.machine()
    started = time.monotonic()
    results, cpu = [], []
    with bl.workdir("bench-fleet-") as wd, bl.Procs(wd) as procs:
        redis, r_port = start_redis(procs)
        primary, p_port = bl.start_upstream(procs, "primary")
        _, f_port = bl.start_upstream(procs, "fallback")
        ports = (p_port, f_port, r_port)
        for n in sizes:
            for fleet in (False, True):
                bl.progress(f"{n} sidecar(s), fleet {'on' if fleet else 'off'}")
                r = run_outage(procs, wd, args, primary, ports, n, fleet)
                results.append(r)
                bl.progress(
                    f"  calls to primary {r['primary_calls']:.0f}, p50 {r['p50_ms']:.0f} ms "
                    f"p99 {r['p99_ms']:.0f} ms, success {r['success']:.1%}, "
                    f"all back {r['recovery_all_s']:.2f} s"
                )
        for rep in range(args.cpu_reps):
            for fleet in (False, True):
                c = run_cpu(procs, wd, args, ports, redis, fleet, rep)
                cpu.append(c)
                bl.progress(
                    f"cpu rep {rep} fleet {'on' if fleet else 'off'}: "
                    f"{c['cpu_us_per_request']:.0f} us/request "
                    f"({c['request_path_us']:.0f} on the request path), idle "
                    f"{c['idle_cpu_ms_per_s']:.1f} ms/s per sidecar, Redis "
                    f"{c['redis_cpu_ms_per_s']:.1f} ms/s"
                )
    data = {
        "command": bl.command_line(),
        "machine": info,
        "args": vars(args),
        "results": results,
        "cpu": cpu,
    }
    write_results(stem, args, info, results, cpu, sizes, data)
    print(f"took {(time.monotonic() - started) / 60:.1f} min")
    return 0


def write_results(
    stem: str,
    args: argparse.Namespace,
    info: dict[str, str],
    results: list[dict[str, Any]],
    cpu: list[dict[str, Any]],
    sizes: list[int],
    data: dict[str, Any],
) -> None:
    md = report(args, info, results, cpu).replace("(fleet.png)", f"({stem}.png)")
    if args.report_only:
        md = md.replace(f"`{bl.command_line()}`", f"`{data['command']}`")
    bl.RESULTS.mkdir(parents=True, exist_ok=True)
    (bl.RESULTS / f"{stem}.md").write_text(md)
    if not chart(bl.RESULTS / f"{stem}.png", results, sizes):
        print("note: no chart (matplotlib unavailable)")
    bl.write_json(f"{stem}.json", data)
    print(md)


if __name__ == "__main__":
    sys.exit(main())

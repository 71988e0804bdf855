"""Where the sidecar's CPU goes: py-spy under JSON c=64 (and SSE c=64), next to the bare relay.

    .venv/bin/python benchmarks/pyspy_profile.py [--quick]

Starts the same processes as ``overhead.py`` (lean upstream, bare relay, sidecar
with breakers, two routes and metrics), drives each proxy with wrk (JSON, c=64)
and loadgen.py (SSE, c=64), and samples it with ``py-spy record`` (installed
into the venv when missing). Writes to ``benchmarks/results/``:

* ``profile.svg``: flamegraph of the sidecar under JSON c=64;
* ``profile-*.txt``: the collapsed stacks (py-spy ``raw``; open them in
  speedscope or any flamegraph tool) of the sidecar (JSON, SSE) and the bare relay;
* ``profile.json``: the tables below as data;
* ``profile.md``: the part between ``<!-- auto:start -->`` and ``<!-- auto:end -->``
  (tables: CPU per request, self time, inclusive time of the sidecar's own
  functions, library cost by the sidecar call site that pays for it, and the
  team's targets from ``overhead.json`` / ``scale.json``). Text outside the
  markers is kept, so the written analysis survives a re-run.

Percentages are of the samples in which the process was on CPU (py-spy leaves
out idle samples); ``us/req`` multiplies them by the CPU per request measured
during the same window from /proc.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import benchlib as bl
import micro
from loadgen import DEFAULT_BODY
from overhead import SIDECAR_TOML, WORKLOADS, WRK_LUA

START, END = "<!-- auto:start -->", "<!-- auto:end -->"
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*)\)$")


def short_file(path: str) -> str:
    for cut in ("site-packages/", "/work/main/", "lib/python3.11/", "lib/python3.12/"):
        if cut in path:
            return path.split(cut, 1)[1]
    return path


def frame_name(raw: str) -> str:
    m = FRAME.match(raw.strip())
    if not m:
        return raw.strip()
    f = short_file(m["file"]).split(":", 1)[0]
    return f"{f}:{m['func']}"


def load_stacks(path: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [frame_name(f) for f in stack.split(";")]
        # py-spy puts a "process ..." / "thread ..." root frame first with -t; skip those
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        out.append((frames, int(count)))
    return out


def area(frame: str) -> str:
    f = frame.split(":", 1)[0]
    for prefix, name in (
        ("sidecar/", "sidecar"),
        ("aiohttp_retry/", "aiohttp_retry"),
        ("aiohttp/", "aiohttp"),
        ("prometheus_client/", "prometheus_client"),
        ("multidict/", "multidict"),
        ("yarl/", "yarl"),
        ("asyncio/", "asyncio"),
        ("logging/", "logging"),
        ("bare_relay", "bare_relay"),
    ):
        if f.startswith(prefix) or f"/{prefix}" in f:
            return name
    return "other"


CENTRES = [
    ("aiohttp TraceConfig (tracing signals)", ("aiohttp/tracing.py", "aiosignal/")),
    ("aiohttp_retry machinery", ("aiohttp_retry/",)),
    ("asyncio.timeout contexts", ("asyncio/timeouts.py",)),
    ("prometheus metrics", ("prometheus_client/",)),
    ("sidecar header filtering", ("sidecar/headers.py",)),
    ("sidecar breaker", ("sidecar/breaker",)),
    ("sidecar routing", ("sidecar/routes.py",)),
    ("sidecar logging", ("sidecar/logs.py", "logging/")),
    (
        "aiohttp client request/response",
        (
            "aiohttp/client.py",
            "aiohttp/client_reqrep.py",
            "aiohttp/connector.py",
            "aiohttp/client_proto.py",
            "aiohttp/payload.py",
            "yarl/",
        ),
    ),
    ("aiohttp server: response out", ("aiohttp/web_response.py", "aiohttp/http_writer.py")),
    (
        "aiohttp server: request in",
        (
            "aiohttp/web_protocol.py",
            "aiohttp/web_request.py",
            "aiohttp/web_app.py",
            "aiohttp/web_urldispatcher.py",
            "aiohttp/http_parser.py",
            "aiohttp/web_middlewares.py",
        ),
    ),
    ("sidecar head-deadline guard", ("sidecar/head_deadline.py", "sidecar/wire/downstream.py")),
    ("sidecar request timer", ("sidecar/exchange.py",)),
    ("sidecar pool hooks", ("sidecar/wire/pool.py",)),
    ("sidecar own code (proxy, upstream, ...)", ("sidecar/",)),
]
"""Cost centres: each sample goes to the innermost frame that matches one of these
file prefixes (frames of aiohttp/streams.py, asyncio plumbing and the process's
entry frames are skipped over), else to "event loop, sockets, other"."""


ENTRY = ("sidecar/cli.py", "sidecar:", "sidecar/__main__.py")
"""The process's entry frames: under every sample, so never a cost centre."""


def centre_of(frames: list[str]) -> str:
    for f in reversed(frames):
        if f.startswith(ENTRY):
            continue
        for name, prefixes in CENTRES:
            if f.startswith(prefixes) or any(f"/{p}" in f for p in prefixes):
                return name
    return "event loop, sockets, other"


def analyse(stacks: list[tuple[list[str], int]], top: int = 25) -> dict[str, Any]:
    total = sum(c for _, c in stacks) or 1
    self_t: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    paid_by: Counter[str] = Counter()  # innermost sidecar frame -> its non-sidecar callee
    centres: Counter[str] = Counter()
    for frames, c in stacks:
        if not frames:
            continue
        centres[centre_of(frames)] += c
        self_t[frames[-1]] += c
        areas[area(frames[-1])] += c
        for f in set(frames):
            incl[f] += c
        own = [i for i, f in enumerate(frames) if f.startswith("sidecar/")]
        if own:
            i = own[-1]
            callee = frames[i + 1] if i + 1 < len(frames) else "(own code)"
            paid_by[f"{frames[i]} -> {callee}"] += c

    def pct(counter: Counter[str], n: int, pred: Any = None) -> list[list[Any]]:
        items = [(k, v) for k, v in counter.most_common() if pred is None or pred(k)]
        return [[k, v / total * 100] for k, v in items[:n]]

    return {
        "samples": total,
        "self": pct(self_t, top),
        "inclusive_sidecar": pct(incl, top, lambda k: k.startswith("sidecar/")),
        "inclusive_all": pct(incl, top),
        "areas": pct(areas, 20),
        "paid_by": pct(paid_by, top),
        "centres": pct(centres, 30),
    }


def record(
    pyspy: str, pid: int, out: Path, fmt: str, seconds: int, rate: int
) -> subprocess.Popen[bytes]:
    cmd = [pyspy, "record", "--pid", str(pid), "--output", str(out), "--format", fmt]
    cmd += ["--duration", str(seconds), "--rate", str(rate), "--nolineno"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def drive(kind: str, url: str, seconds: int, lua: Path, wrk: str) -> dict[str, Any]:
    if kind == "json":
        cmd = [wrk, "-t1", "-c64", f"-d{seconds}s", "--timeout", "10s", "-s", str(lua), url]
        r = bl.run_json_tool(cmd, timeout=seconds + 30, marker="WRK ")
        return {"requests": r["requests"] - r["status"], "events": 0}
    cmd = [bl.PY, str(bl.HERE / "loadgen.py"), "closed", "--url", url, "--concurrency", "64"]
    cmd += ["--duration", str(seconds), "--stream", "--timeout", "10"]
    r = bl.run_json_tool(cmd, timeout=seconds + 60, marker="RESULT ")
    return {"requests": r["requests"], "events": r["events_total"]}


def profile_one(
    pyspy: str,
    name: str,
    pid: int,
    kind: str,
    url: str,
    seconds: int,
    fmt: str,
    out: Path,
    ctx: dict[str, Any],
) -> dict[str, Any]:
    cpu0 = bl.cpu_seconds(pid)
    spy = record(pyspy, pid, out, fmt, seconds + 1, ctx["rate"])
    time.sleep(0.5)  # py-spy attached
    load = drive(kind, url, seconds, ctx["lua"], ctx["wrk"])
    _, err = spy.communicate(timeout=60)
    cpu = bl.cpu_seconds(pid) - cpu0
    if spy.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed for {name}: {err.decode()[-400:]}")
    n = max(load["requests"], 1)
    return {
        "name": name,
        "kind": kind,
        "requests": load["requests"],
        "events": load["events"],
        "cpu_s": cpu,
        "cpu_us_per_req": cpu / n * 1e6,
        "cpu_us_per_event": cpu / load["events"] * 1e6 if load["events"] else float("nan"),
    }


def targets_rows() -> list[list[Any]]:
    rows: list[list[Any]] = []
    ov = bl.read_json("overhead.json")
    if ov:
        rows += [[*r, "overhead.md"] for r in ov["targets"]]
    sc = bl.read_json("scale.json")
    if sc:
        idle, peak = sc["baseline"]["rss"], sc["peak_rss"]
        rows.append(["RSS idle", "<= 60 MiB", f"{idle:.1f} MiB", "yes" if idle <= 60 else "**no**"])
        rows[-1].append("scale.md")
        rows.append(
            [
                "RSS with 1,000 streams",
                "<= 250 MiB",
                f"{peak:.1f} MiB",
                "yes" if peak <= 250 else "**no**",
                "scale.md",
            ]
        )
    return rows


def auto_section(
    runs: list[dict[str, Any]],
    analyses: dict[str, dict[str, Any]],
    micro_rows: list[list[Any]],
    command: str,
    info: dict[str, str],
    note: str = "",
) -> str:
    lines = [
        START,
        "",
        f"Generated by `{command}`{note} on {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        bl.machine_md(info),
        "",
        "### The team's targets (from the full runs' results)",
        "",
        bl.md_table(["target", "goal", "measured", "met", "source"], targets_rows()),
        "",
        "### CPU per request while profiled (from /proc, py-spy attached)",
        "",
        bl.md_table(
            ["process", "workload", "requests", "CPU s", "CPU us/req", "CPU us/SSE event"],
            [
                [
                    r["name"],
                    r["kind"],
                    r["requests"],
                    r["cpu_s"],
                    r["cpu_us_per_req"],
                    r["cpu_us_per_event"],
                ]
                for r in runs
            ],
        ),
        "",
    ]
    per_req = {f"{r['name']} {r['kind']}": r["cpu_us_per_req"] for r in runs}
    for key, a in analyses.items():
        us = per_req.get(key, float("nan"))
        lines += [
            f"### {key}: {a['samples']} samples",
            "",
            "Cost centres (each sample charged to the innermost frame of a known "
            "component; see `CENTRES` in pyspy_profile.py):",
            "",
            bl.md_table(
                ["centre", "% CPU", "us/req"], [[k, v, v / 100 * us] for k, v in a["centres"]]
            ),
            "",
            "By library (self time of the innermost frame):",
            "",
            bl.md_table(["area", "% CPU", "us/req"], [[k, v, v / 100 * us] for k, v in a["areas"]]),
            "",
            "Top self time (file:function):",
            "",
            bl.md_table(
                ["frame", "% CPU", "us/req"], [[k, v, v / 100 * us] for k, v in a["self"][:15]]
            ),
            "",
        ]
        if a["inclusive_sidecar"]:
            lines += [
                "Inclusive time of the sidecar's own functions:",
                "",
                bl.md_table(
                    ["frame", "% CPU", "us/req"],
                    [[k, v, v / 100 * us] for k, v in a["inclusive_sidecar"][:20]],
                ),
                "",
                "Who pays: innermost sidecar frame -> the library function it called (inclusive):",
                "",
                bl.md_table(
                    ["sidecar frame -> callee", "% CPU", "us/req"],
                    [[k, v, v / 100 * us] for k, v in a["paid_by"][:20]],
                ),
                "",
            ]
        else:
            lines += [
                "Inclusive (top frames):",
                "",
                bl.md_table(
                    ["frame", "% CPU", "us/req"],
                    [[k, v, v / 100 * us] for k, v in a["inclusive_all"][:20]],
                ),
                "",
            ]
    if micro_rows:
        lines += [
            "### Micro-costs of building blocks (`benchmarks/micro.py`, in-process, best of 5)",
            "",
            bl.md_table(["item", "paid", "CPU us per call"], micro_rows),
            "",
        ]
    lines.append(END)
    return "\n".join(lines)


TEMPLATE = """# Profile: where the sidecar's CPU goes

Command: `{command}`. The flamegraph is `profile.svg`; the collapsed stacks are
`profile-*.txt`.

{auto}
"""


def write_md(auto: str, stem: str = "profile") -> Path:
    md_path = bl.RESULTS / f"{stem}.md"
    if md_path.exists() and START in (text := md_path.read_text()) and END in text:
        before, rest = text.split(START, 1)
        after = rest.split(END, 1)[1]
        md_path.write_text(before + auto + after)
    else:
        md_path.write_text(TEMPLATE.format(command=bl.command_line(), auto=auto))
    return md_path


RENOTE = " (tables rebuilt from its raw files with `--reanalyse`)"


def reanalyse() -> int:
    data = bl.read_json("profile.json")
    if not data:
        print("no results/profile.json: run a profile first")
        return 1
    analyses = {}
    for r in data["runs"]:
        key = f"{r['name']} {r['kind']}"
        stem = "sidecar" if r["name"] == "sidecar" else "bare"
        analyses[key] = analyse(load_stacks(bl.RESULTS / f"profile-{stem}-{r['kind']}.txt"))
    data["analyses"] = analyses
    bl.write_json("profile.json", data)
    command = data.get("command", "?")
    info = data.get("machine") or bl.machine()
    auto = auto_section(data["runs"], analyses, data.get("micro", []), command, info, RENOTE)
    print(f"wrote {write_md(auto)}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 s per profile, profile-quick.* files")
    p.add_argument("--seconds", type=int, default=None, help="seconds of load per profile")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument(
        "--reanalyse",
        action="store_true",
        help="no new profiles: rebuild the tables from the profile-*.txt and profile.json on disk",
    )
    args = p.parse_args()
    if args.reanalyse:
        return reanalyse()
    seconds = args.seconds or (4 if args.quick else 15)
    stem = "profile-quick" if args.quick else "profile"  # a quick run keeps the full results
    assert any(w[0] == "json c=64" for w in WORKLOADS)
    pyspy = str(bl.VENV_BIN / "py-spy")
    if not Path(pyspy).exists():
        print("installing py-spy into the venv (pip) ...", flush=True)
        subprocess.run([bl.PY, "-m", "pip", "install", "-q", "py-spy"], check=False)
    if not Path(pyspy).exists():
        print("py-spy unavailable")
        return 1
    wrk = bl.apt_install("wrk", "wrk")
    if wrk is None:
        print("wrk unavailable")
        return 1
    bl.raise_fd_limit()
    info = bl.machine()
    res = bl.RESULTS
    res.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    analyses: dict[str, dict[str, Any]] = {}
    with bl.workdir("bench-profile-") as wd, bl.Procs(wd) as procs:
        lua = wd / "post.lua"
        lua.write_text(WRK_LUA % DEFAULT_BODY.decode())
        ctx = {"lua": lua, "wrk": wrk, "rate": args.rate}
        _, up = bl.start_upstream(procs, "upstream", "--sse-chunks", "20", "--sse-gap-ms", "10")
        bare_port = bl.free_port()
        cmd = [bl.PY, str(bl.HERE / "bare_relay.py"), "--port", str(bare_port)]
        bare = procs.start("bare-relay", [*cmd, "--upstream", f"http://127.0.0.1:{up}"])
        bl.wait_port(bare_port, bare)
        sc_port, admin = bl.free_port(), bl.free_port()
        config = bl.write_sidecar_config(
            wd / "sidecar.toml", SIDECAR_TOML.format(up=up), listen=sc_port, admin=admin
        )
        sc = bl.start_sidecar(procs, "sidecar", config)
        path = "/v1/chat/completions"
        plan = [
            ("sidecar", sc.pid, sc_port, "json", "flamegraph", res / f"{stem}.svg"),
            ("sidecar", sc.pid, sc_port, "json", "raw", res / f"{stem}-sidecar-json.txt"),
            ("bare relay", bare.pid, bare_port, "json", "raw", res / f"{stem}-bare-json.txt"),
            ("sidecar", sc.pid, sc_port, "sse", "raw", res / f"{stem}-sidecar-sse.txt"),
            ("bare relay", bare.pid, bare_port, "sse", "raw", res / f"{stem}-bare-sse.txt"),
        ]
        for _, _, port, kind, _, _ in plan[:3]:  # warm-up
            drive(kind, f"http://127.0.0.1:{port}{path}", 1, lua, wrk)
        for name, pid, port, kind, fmt, out in plan:
            bl.progress(f"py-spy: {name} under {kind} c=64, {seconds} s -> {out.name}")
            r = profile_one(
                pyspy, name, pid, kind, f"http://127.0.0.1:{port}{path}", seconds, fmt, out, ctx
            )
            bl.progress(f"  {r['cpu_us_per_req']:.0f} us CPU/request")
            if fmt == "raw":
                runs.append(r)
                analyses[f"{name} {kind}"] = analyse(load_stacks(out))
    bl.progress("micro-costs (benchmarks/micro.py)")
    micro_rows = micro.measure_all()
    command = bl.command_line()
    data = {"command": command, "machine": info, "runs": runs, "analyses": analyses}
    bl.write_json(f"{stem}.json", {**data, "micro": micro_rows})
    print(f"wrote {write_md(auto_section(runs, analyses, micro_rows, command, info), stem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

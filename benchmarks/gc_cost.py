"""The garbage collector's cost per JSON request at concurrency 64, with and without tuning.

    .venv/bin/python benchmarks/gc_cost.py [--reps 8] [--seconds 3]

``sidecar serve`` collects and freezes what startup built and raises the young
generation's threshold (``sidecar/collector.py``). This measures what that buys:
three proxies in front of one lean upstream (``benchmarks/upstream.py``), each
loaded in turn by wrk (JSON chat completion, concurrency 64, ``--seconds`` per
cell, the order rotated per repetition):

* ``sidecar``: ``sidecar serve`` as shipped (``overhead.py``'s config);
* ``sidecar, untuned``: the same, with ``tune_for_serving`` replaced by a no-op;
* ``bare relay``: ``benchmarks/bare_relay.py`` (CPython's defaults).

Each runs under a small bootstrap (``BOOT``) that times every collection with
``gc.callbacks`` and writes the running totals to its log on ``SIGUSR2``; the
script reads them before and after each cell, with the process's CPU time from
``/proc``. The collector's time is measured with ``time.perf_counter`` around each
collection, so it includes the callbacks' own few microseconds per collection.
Writes ``benchmarks/results/gc_cost.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

import benchlib as bl
from loadgen import DEFAULT_BODY
from overhead import SIDECAR_TOML, WRK_LUA, run_wrk

BOOT = """
import gc, json, signal, sys, time
_totals = [[0, 0.0], [0, 0.0], [0, 0.0]]
_start = [0.0]

def _timed(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        entry = _totals[info["generation"]]
        entry[0] += 1
        entry[1] += time.perf_counter() - _start[0]

def _report(signum, frame):
    sys.stderr.write("GC_TOTALS " + json.dumps(_totals) + "\\n")
    sys.stderr.flush()

gc.callbacks.append(_timed)
signal.signal(signal.SIGUSR2, _report)
target, sys.argv = sys.argv[1], sys.argv[2:]
if target == "bare":
    import runpy
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    if target == "untuned":
        import sidecar.server
        sidecar.server.tune_for_serving = lambda: None
    from sidecar.cli import main
    sys.exit(main(sys.argv))
"""
TARGETS = ["sidecar", "sidecar, untuned", "bare relay"]


def gc_totals(proc: bl.Proc) -> list[tuple[int, float]]:
    """Ask ``proc`` for its collector totals: (collections, seconds) per generation."""
    assert proc.log is not None
    with proc.log.open("rb") as f:
        f.seek(0, 2)
        offset = f.tell()
        proc.popen.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 5
        text = b""
        while b"GC_TOTALS " not in text or not text.rstrip(b" ").endswith(b"\n"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} did not report; see {proc.log}")
            time.sleep(0.01)
            f.seek(offset)
            text = f.read()
    line = text.split(b"GC_TOTALS ", 1)[1].split(b"\n", 1)[0]
    return [(int(n), float(s)) for n, s in json.loads(line)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default="gc_cost")
    args = ap.parse_args()
    started = time.monotonic()
    info = bl.machine()
    wrk = bl.apt_install("wrk", "wrk")
    if wrk is None:
        raise SystemExit("wrk is needed (apt install wrk)")
    cells: list[dict[str, Any]] = []
    with bl.workdir("bench-gc-") as wd, bl.Procs(wd) as procs:
        lua = wd / "post.lua"
        lua.write_text(WRK_LUA % DEFAULT_BODY.decode())
        _, up = bl.start_upstream(procs, "upstream")
        ports: dict[str, int] = {}
        proxies: dict[str, bl.Proc] = {}
        for name in TARGETS:
            port = ports[name] = bl.free_port()
            if name == "bare relay":
                cmd = [bl.PY, "-c", BOOT, "bare", str(bl.HERE / "bare_relay.py")]
                cmd += ["--port", str(port), "--upstream", f"http://127.0.0.1:{up}"]
            else:
                config = bl.write_sidecar_config(
                    wd / f"{port}.toml", SIDECAR_TOML.format(up=up), listen=port,
                    admin=bl.free_port(), log_level="info",
                )  # fmt: skip
                boot = "untuned" if "untuned" in name else "tuned"
                cmd = [bl.PY, "-c", BOOT, boot, "serve", "--config", str(config)]
            proxies[name] = procs.start(name.replace(", ", "-"), cmd)
            bl.wait_port(port, proxies[name])
        for name in TARGETS:  # warm-up
            run_wrk(wrk, lua, f"http://127.0.0.1:{ports[name]}/v1/chat/completions", 64, 1)
        for rep in range(args.reps):
            order = TARGETS[rep % 3 :] + TARGETS[: rep % 3]
            for name in order:
                proc = proxies[name]
                cpu0, gc0 = bl.cpu_seconds(proc.pid), gc_totals(proc)
                url = f"http://127.0.0.1:{ports[name]}/v1/chat/completions"
                r = run_wrk(wrk, lua, url, 64, args.seconds)
                cpu1, gc1 = bl.cpu_seconds(proc.pid), gc_totals(proc)
                n = r["requests"]
                cells.append(
                    {
                        "rep": rep,
                        "target": name,
                        "requests": n,
                        "errors": r["errors"],
                        "cpu_us_per_req": (cpu1 - cpu0) / n * 1e6,
                        "gc_us_per_req": sum(b[1] - a[1] for a, b in zip(gc0, gc1, strict=True))
                        / n
                        * 1e6,
                        "collections_per_1k": [
                            (b[0] - a[0]) / n * 1000 for a, b in zip(gc0, gc1, strict=True)
                        ],
                    }
                )
                bl.progress(
                    f"rep {rep} {name}: {cells[-1]['cpu_us_per_req']:.0f} us/req CPU, "
                    f"{cells[-1]['gc_us_per_req']:.1f} us/req collector"
                )
    report(cells, args, info, time.monotonic() - started)


def report(cells: list[dict[str, Any]], args: Any, info: dict[str, str], took: float) -> None:
    def of(name: str, key: str) -> list[Any]:
        return [c[key] for c in cells if c["target"] == name]

    def paired(a: str, b: str) -> float:
        by_rep = {(c["rep"], c["target"]): c["cpu_us_per_req"] for c in cells}
        return bl.median([by_rep[r, a] / by_rep[r, b] for r in range(args.reps)])

    rows = []
    for name in TARGETS:
        coll = of(name, "collections_per_1k")
        rows.append(
            [
                name,
                f"{bl.median(of(name, 'cpu_us_per_req')):.0f}",
                f"{bl.median(of(name, 'gc_us_per_req')):.1f}",
                " / ".join(f"{bl.median([c[g] for c in coll]):.1f}" for g in range(3)),
                sum(of(name, "errors")),
            ]
        )
    lines = [
        "# The garbage collector's cost per JSON request (concurrency 64)",
        "",
        f"Command: `{bl.command_line()}` (took {bl.fmt_s(took)})",
        "",
        bl.machine_md(info),
        "",
        f"{args.reps} interleaved repetitions x {args.seconds:g} s per proxy; medians over "
        "the repetitions. `collector us/req`: time inside collections (gc.callbacks) per "
        "request; see `benchmarks/gc_cost.py`.",
        "",
        bl.md_table(
            [
                "proxy",
                "CPU us/req",
                "collector us/req",
                "collections per 1k req (gen 0/1/2)",
                "errors",
            ],
            rows,
        ),
        "",
        "Paired within each repetition (median of the per-repetition ratios of CPU per "
        f"request): tuned / untuned **{paired('sidecar', 'sidecar, untuned'):.2f}x**, "
        f"tuned / bare relay {paired('sidecar', 'bare relay'):.2f}x, "
        f"untuned / bare relay {paired('sidecar, untuned', 'bare relay'):.2f}x.",
        "",
    ]
    out = bl.RESULTS / f"{args.out}.md"
    out.write_text("\n".join(lines))
    bl.write_json(f"{args.out}.json", {"args": vars(args), "machine": info, "cells": cells})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

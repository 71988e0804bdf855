"""Instructions per proxied request under callgrind: a noise-free ratio to the bare relay.

    .venv/bin/python benchmarks/instructions.py [--ref DIR ...] [--sse-gap-ms 3] [--out STEM]

On a shared 2-core machine the CPU time per request of ``overhead.py`` moves by
25% between two runs of the same code (scheduling, batching, neighbours). This
counts user-space instructions instead: each proxy runs under ``valgrind
--tool=callgrind`` (Debian's valgrind, installed when missing), is sent N
sequential requests on one keep-alive connection (after a warm-up), and its
instructions at two values of N give the cost of one request as
``(Ir(400) - Ir(100)) / 300``. The count is deterministic to about 0.2% and
leaves out the kernel (system calls cost both proxies alike, one ``send`` per
write); it is the A/B meter for changes on the hot path, while ``overhead.py``
stays the measure of the issue's bar (wall-clock CPU, concurrency 64).

Targets: ``benchmarks/bare_relay.py``, the sidecar of this checkout (with ``--tier``
also this checkout with the chat route's two candidates as one ``least_loaded`` tier,
the chooser's cost; with ``--tracing RATIO`` (repeatable) also this checkout with a
``[tracing]`` table at that ``sample_ratio`` exporting to ``benchmarks/otlp_sink.py``;
with ``--bounds`` also this checkout with everything of issue #24
configured on the chat route and its upstreams: ``hedge_after_ms``, the retry budget,
full jitter, ``rate_limit_scope = "credential"``, and every request then carries the
openai SDK's ``x-stainless-read-timeout`` and ``x-stainless-retry-count``, to every
target alike), and each ``--ref DIR`` (another checkout's root, e.g. a ``git
worktree`` at an older commit), all with ``overhead.py``'s config (two routes, breakers
on both upstreams, metrics, the default log level, the access log on). Workloads: the
JSON chat completion, and an SSE stream of 20 events (``--sse-gap-ms`` apart: separate
chunks, as in ``overhead.py``; on a busy machine use ``--sse-gap-ms 20``: callgrind
slows the proxy so much that events 3 ms apart coalesce into fewer reads, and the SSE
count then depends on scheduling). Writes ``results/instructions.{md,json}`` (``--out
STEM``: ``results/STEM.{md,json}``).

``--functions N`` (default 15; 0: off) also says where the instructions go:
``callgrind_annotate`` gives each run's exclusive instructions per C function (the
interpreter's, the C extensions': Python code shows up as
``_PyEval_EvalFrameDefault`` and the object functions it calls), the same
difference of the two runs gives them per request, and the report lists, per
workload, the N functions whose count differs most between this checkout and the
other targets.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl
from loadgen import DEFAULT_BODY
from overhead import SIDECAR_TOML, TRACING_TOML, bounds_toml, tier_toml

ROOT = Path(__file__).resolve().parent.parent
PY = str(bl.VENV_BIN / "python")
RUNS = (100, 400)
WARM = 50


SDK_HEADERS = "x-stainless-read-timeout: 600\r\nx-stainless-retry-count: 0\r\n"
"""What the openai SDK announces on every request (its timeout, seconds; a first try):
sent with ``--bounds`` so the client-deadline rule does its work on every request."""


def request_bytes(port: int, sse: bool, sdk: bool = False) -> bytes:
    body = DEFAULT_BODY[:-1] + b', "stream": true}' if sse else DEFAULT_BODY
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer sk-bench\r\n"
        f"{SDK_HEADERS if sdk else ''}Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def drive(port: int, n: int, sse: bool, sdk: bool = False) -> None:
    """``n`` requests one after another on one connection, each read to its end
    (``sdk``: with the openai SDK's announcement headers)."""
    raw = request_bytes(port, sse, sdk)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(n):
            s.sendall(raw)
            buf = b""
            while True:
                got = s.recv(65536)
                if not got:
                    raise RuntimeError("the proxy closed the connection")
                buf += got
                if sse:
                    if buf.endswith(b"\r\n0\r\n\r\n"):
                        break
                    continue
                head, sep, rest = buf.partition(b"\r\n\r\n")
                m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if sep and m and len(rest) >= int(m.group(1)):
                    break


_ANNOTATED = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(.+?)(?: \[(.+)\])?$")


def by_function(path: Path) -> dict[str, int]:
    """Exclusive instructions per C function of one callgrind output, recursion levels
    (``f'2``) merged; keys ``function (object file)``."""
    out = subprocess.run(
        ["callgrind_annotate", "--threshold=100", "--inclusive=no", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    funcs: dict[str, int] = {}
    objs: dict[str, str] = {}  # callgrind_annotate names a function's object file once
    for line in out.splitlines():
        m = _ANNOTATED.match(line)
        if m is None or m.group(2) == "PROGRAM TOTALS":
            continue
        name = re.sub(r"'\d+$", "", m.group(2).rsplit(":", 1)[-1])
        if m.group(3):
            objs.setdefault(name, Path(m.group(3)).name)
        funcs[name] = funcs.get(name, 0) + int(m.group(1).replace(",", ""))
    return {f"{f} ({objs[f]})" if f in objs else f: n for f, n in funcs.items()}


def count(
    target: str,
    n: int,
    sse: bool,
    gap_ms: float,
    wd: Path,
    functions: bool,
    variant: str | None,
    sdk: bool = False,
) -> tuple[int, dict[str, int]]:
    """Instructions of the proxy ``target`` ("bare" or a checkout) over ``n`` requests,
    and (with ``functions``) per C function; ``variant``: the config's (``tier``,
    ``bounds``: :func:`sidecar_toml`); ``sdk``: requests with the SDK's headers."""
    with bl.Procs(wd) as procs:
        _, up_port = bl.start_upstream(
            procs, "upstream", "--sse-chunks", "20", "--sse-gap-ms", str(gap_ms)
        )
        port = bl.free_port()
        out = wd / f"callgrind.{os.getpid()}.{time.monotonic_ns()}"
        vg = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no"]
        env = {**os.environ, "PYTHONMALLOC": "malloc"}
        if target == "bare":
            cmd = [PY, str(ROOT / "benchmarks/bare_relay.py"), "--port", str(port),
                   "--upstream", f"http://127.0.0.1:{up_port}"]  # fmt: skip
            cwd = None
        else:
            sink_port = None
            if variant is not None and variant.startswith("tracing"):
                sink_port = bl.free_port()  # a no-op OTLP receiver: the exports are counted
                sink_cmd = [PY, str(ROOT / "benchmarks/otlp_sink.py"), "--port", str(sink_port)]
                bl.wait_port(sink_port, procs.start("otlp-sink", sink_cmd))
            cfg = wd / "sidecar.toml"
            cfg.write_text(
                f'[server]\nlisten = "127.0.0.1:{port}"\n'
                f'admin_listen = "127.0.0.1:{bl.free_port()}"\n'
                + sidecar_toml(up_port, variant, sink_port)
            )
            cmd = [PY, "-m", "sidecar", "serve", "--config", str(cfg)]
            env["PYTHONPATH"] = target
            cwd = target
        with open(wd / "proxy.log", "w") as log:
            proxy = subprocess.Popen(vg + cmd, env=env, cwd=cwd, stdout=log, stderr=log)
        try:
            bl.wait_port(port, timeout=180)
            drive(port, WARM, sse, sdk)
            drive(port, n, sse, sdk)
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(timeout=180)
        text = out.read_text()
        funcs = by_function(out) if functions else {}
        out.unlink()
    m = re.search(r"^summary: (\d+)", text, re.M)
    if m is None:
        raise RuntimeError(f"no callgrind summary for {target}")
    return int(m.group(1)), funcs


def per_request(
    target: str,
    sse: bool,
    gap_ms: float,
    functions: bool,
    variant: str | None = None,
    sdk: bool = False,
) -> tuple[float, dict[str, float]]:
    """Instructions per request, and per C function per request (those of at least
    10 per request either way)."""
    with bl.workdir("instructions-") as wd:
        (low, f_low), (high, f_high) = (
            count(target, n, sse, gap_ms, wd, functions, variant, sdk) for n in RUNS
        )
    k = RUNS[1] - RUNS[0]
    per_fn = {f: (f_high.get(f, 0) - f_low.get(f, 0)) / k for f in {*f_low, *f_high}}
    return (high - low) / k, {f: v for f, v in per_fn.items() if abs(v) >= 10}


def functions_md(data: dict[str, dict[str, Any]], this: str, top: int) -> list[str]:
    """Per workload, the ``top`` functions whose instructions per request differ most
    between the checkout ``this`` and any other target."""
    labels = list(data)
    others = [x for x in labels if x != this]
    out = []
    for wl, title in (("json", "JSON request"), ("sse_stream", "SSE stream (20 events)")):
        fns = {lb: data[lb]["functions"][wl] for lb in labels}
        names = set().union(*fns.values())

        spread = {
            f: max(abs(fns[this].get(f, 0.0) - fns[o].get(f, 0.0)) for o in others) for f in names
        }
        rows: list[list[object]] = []
        for f in sorted(names, key=spread.__getitem__, reverse=True)[:top]:
            mine = fns[this].get(f, 0.0)
            rows.append(
                [f"`{f}`", *(f"{fns[lb].get(f, 0.0):,.0f}" for lb in labels)]
                + [f"{mine - fns[o].get(f, 0.0):+,.0f}" for o in others]
            )
        rows.append(
            ["**all**", *(f"{data[lb][wl]:,.0f}" for lb in labels)]
            + [f"{data[this][wl] - data[o][wl]:+,.0f}" for o in others]
        )
        head = ["function (object)", *labels, *(f"this - {o}" for o in others)]
        out += [
            f"### Per {title}: the {top} functions that differ most",
            bl.md_table(head, rows),
        ]
    return out


def sidecar_toml(up_port: int, variant: str | None, sink_port: int | None = None) -> str:
    """``overhead.py``'s config; with ``tier`` its chat route shares load between
    primary and backup (``tier = 0`` on both, ``least_loaded``); with ``bounds`` the
    chat route hedges after 2 s (never reached by a healthy upstream: the cost is the
    armed timer) and the rest of issue #24 (:func:`overhead.bounds_toml`); with
    ``tracing:RATIO`` a ``[tracing]`` table at that ``sample_ratio`` exporting to the
    OTLP receiver on ``sink_port``."""
    if variant == "tier":
        return tier_toml(up_port)
    if variant == "bounds":
        return bounds_toml(up_port)
    text = SIDECAR_TOML.format(up=up_port)
    if variant is not None and variant.startswith("tracing:"):
        ratio = float(variant.partition(":")[2])
        text += TRACING_TOML.format(port=sink_port, ratio=ratio)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ref", action="append", default=[], help="another checkout's root")
    p.add_argument("--sse-gap-ms", type=float, default=3.0)
    p.add_argument("--out", default="instructions", help="results file stem")
    p.add_argument(
        "--tier",
        action="store_true",
        help="also this checkout with the chat route as a two-member tier (least_loaded)",
    )
    p.add_argument(
        "--bounds",
        action="store_true",
        help="also this checkout with #24's bounds configured (hedge_after_ms, the retry "
        "budget, jitter, rate_limit_scope); every request carries the SDK's headers",
    )
    p.add_argument(
        "--tracing",
        type=float,
        action="append",
        default=[],
        metavar="RATIO",
        help="also this checkout with [tracing] at this sample_ratio, exporting to a local "
        "no-op OTLP receiver (repeatable)",
    )
    p.add_argument("--json-only", action="store_true", help="leave out the SSE workload")
    p.add_argument(
        "--functions",
        type=int,
        default=15,
        metavar="N",
        help="list the N C functions that differ most per request (0: off)",
    )
    a = p.parse_args()
    if bl.apt_install("valgrind", "valgrind") is None:
        sys.exit("valgrind is needed")
    started = time.monotonic()
    info = bl.machine()
    this = f"sidecar ({bl.git_state()})"
    targets: list[tuple[str, str, str | None]] = [
        ("bare relay", "bare", None),
        (this, str(ROOT), None),
    ]
    if a.tier:
        targets.append((f"sidecar, tier route ({bl.git_state()})", str(ROOT), "tier"))
    if a.bounds:
        targets.append((f"sidecar, #24 bounds on ({bl.git_state()})", str(ROOT), "bounds"))
    for ratio in a.tracing:
        targets.append(
            (f"sidecar, tracing {ratio:g} ({bl.git_state()})", str(ROOT), f"tracing:{ratio}")
        )
    for r in a.ref:
        ref = Path(r).resolve()
        targets.append((f"sidecar at {ref.name} ({bl.git_state(ref)})", str(ref), None))
    rows, data = [], {}
    for label, target, variant in targets:
        fns = a.functions > 0
        json_i, json_f = per_request(target, False, a.sse_gap_ms, fns, variant, a.bounds)
        sse_i, sse_f = (
            (0.0, {})
            if a.json_only
            else per_request(target, True, a.sse_gap_ms, fns, variant, a.bounds)
        )
        data[label] = {"json": json_i, "sse_stream": sse_i}
        if a.functions > 0:
            data[label]["functions"] = {"json": json_f, "sse_stream": sse_f}
        print(f"{label}: {json_i:,.0f} per JSON request, {sse_i:,.0f} per SSE stream", flush=True)
    info["loadavg at end"] = bl.loadavg()
    bare = data["bare relay"]
    for label, d in data.items():
        rows.append([label, f"{d['json']:,.0f}", f"{d['json'] / bare['json']:.3f}",
                     f"{d['sse_stream']:,.0f}", f"{d['sse_stream'] / 20:,.0f}",
                     f"{d['sse_stream'] / bare['sse_stream']:.3f}"
                     if bare["sse_stream"] else "-"])  # fmt: skip
    headers = ["target", "per JSON request", "x bare relay", "per SSE stream",
               "per SSE event (all-in)", "x bare relay"]  # fmt: skip
    md = "\n\n".join(
        [
            "# Instructions per proxied request (callgrind)",
            f"Command: `{bl.command_line()}` (took {(time.monotonic() - started) / 60:.1f} min)",
            bl.machine_md(info),
            "User-space instructions of the proxy process per request: (Ir after "
            f"{RUNS[1]} requests - Ir after {RUNS[0]}) / {RUNS[1] - RUNS[0]}, one keep-alive "
            "connection, requests one after another; the SSE stream is 20 events "
            f"{a.sse_gap_ms:g} ms apart. Kernel time is not counted. See the module docstring.",
            bl.md_table(headers, rows),
        ]
        + (
            [
                "## Where the instructions go",
                "Exclusive instructions per request by C function (`callgrind_annotate "
                "--inclusive=no`, the same difference of the two runs), the functions "
                f"whose count differs most between `{this}` and another target first; "
                "`this - X` is this checkout's count minus X's. Python code runs inside "
                "`_PyEval_EvalFrameDefault` and the object functions it calls, so a "
                "Python-level change shows up spread over those.",
                *functions_md(data, this, a.functions),
            ]
            if a.functions > 0 and len(data) > 1
            else []
        )
    )
    (bl.RESULTS / f"{a.out}.md").write_text(md + "\n")
    bl.write_json(f"{a.out}.json", data)
    print(f"wrote {bl.RESULTS / (a.out + '.md')}")


if __name__ == "__main__":
    main()

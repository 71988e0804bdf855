"""Instructions per proxied request under callgrind: a noise-free ratio to the bare relay.

    .venv/bin/python benchmarks/instructions.py [--ref DIR ...] [--sse-gap-ms 3]

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

Targets: ``benchmarks/bare_relay.py``, the sidecar of this checkout, and each
``--ref DIR`` (another checkout's root, e.g. a ``git worktree`` at an older commit),
all with ``overhead.py``'s config (two routes, breakers on both upstreams,
metrics, the default log level, the access log on). Workloads: the JSON chat
completion, and an SSE stream of 20 events (``--sse-gap-ms`` apart: separate
chunks, as in ``overhead.py``). Writes ``results/instructions.{md,json}``.
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

import benchlib as bl
from loadgen import DEFAULT_BODY
from overhead import SIDECAR_TOML

ROOT = Path(__file__).resolve().parent.parent
PY = str(bl.VENV_BIN / "python")
RUNS = (100, 400)
WARM = 50


def request_bytes(port: int, sse: bool) -> bytes:
    body = DEFAULT_BODY[:-1] + b', "stream": true}' if sse else DEFAULT_BODY
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer sk-bench\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def drive(port: int, n: int, sse: bool) -> None:
    """``n`` requests one after another on one connection, each read to its end."""
    raw = request_bytes(port, sse)
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


def count(target: str, n: int, sse: bool, gap_ms: float, wd: Path) -> int:
    """Instructions of the proxy ``target`` ("bare" or a checkout) over ``n`` requests."""
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
            cfg = wd / "sidecar.toml"
            cfg.write_text(
                f'[server]\nlisten = "127.0.0.1:{port}"\n'
                f'admin_listen = "127.0.0.1:{bl.free_port()}"\n' + SIDECAR_TOML.format(up=up_port)
            )
            cmd = [PY, "-m", "sidecar", "serve", "--config", str(cfg)]
            env["PYTHONPATH"] = target
            cwd = target
        with open(wd / "proxy.log", "w") as log:
            proxy = subprocess.Popen(vg + cmd, env=env, cwd=cwd, stdout=log, stderr=log)
        try:
            bl.wait_port(port, timeout=180)
            drive(port, WARM, sse)
            drive(port, n, sse)
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(timeout=180)
        text = out.read_text()
        out.unlink()
    m = re.search(r"^summary: (\d+)", text, re.M)
    if m is None:
        raise RuntimeError(f"no callgrind summary for {target}")
    return int(m.group(1))


def per_request(target: str, sse: bool, gap_ms: float) -> float:
    with bl.workdir("instructions-") as wd:
        low, high = (count(target, n, sse, gap_ms, wd) for n in RUNS)
    return (high - low) / (RUNS[1] - RUNS[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ref", action="append", default=[], help="another checkout's root")
    p.add_argument("--sse-gap-ms", type=float, default=3.0)
    p.add_argument("--out", default="instructions")
    a = p.parse_args()
    if bl.apt_install("valgrind", "valgrind") is None:
        sys.exit("valgrind is needed")
    started = time.monotonic()
    targets = [("bare relay", "bare"), (f"sidecar ({bl.git_state()})", str(ROOT))]
    targets += [(f"sidecar at {Path(r).name}", str(Path(r).resolve())) for r in a.ref]
    rows, data = [], {}
    for label, target in targets:
        json_i = per_request(target, False, a.sse_gap_ms)
        sse_i = per_request(target, True, a.sse_gap_ms)
        data[label] = {"json": json_i, "sse_stream": sse_i}
        print(f"{label}: {json_i:,.0f} per JSON request, {sse_i:,.0f} per SSE stream", flush=True)
    bare = data["bare relay"]
    for label, d in data.items():
        rows.append([label, f"{d['json']:,.0f}", f"{d['json'] / bare['json']:.3f}",
                     f"{d['sse_stream']:,.0f}", f"{d['sse_stream'] / 20:,.0f}",
                     f"{d['sse_stream'] / bare['sse_stream']:.3f}"])  # fmt: skip
    headers = ["target", "per JSON request", "x bare relay", "per SSE stream",
               "per SSE event (all-in)", "x bare relay"]  # fmt: skip
    md = "\n\n".join(
        [
            "# Instructions per proxied request (callgrind)",
            f"Command: `{bl.command_line()}` (took {(time.monotonic() - started) / 60:.1f} min)",
            bl.machine_md(bl.machine()),
            "User-space instructions of the proxy process per request: (Ir after "
            f"{RUNS[1]} requests - Ir after {RUNS[0]}) / {RUNS[1] - RUNS[0]}, one keep-alive "
            "connection, requests one after another; the SSE stream is 20 events "
            f"{a.sse_gap_ms:g} ms apart. Kernel time is not counted. See the module docstring.",
            bl.md_table(headers, rows),
        ]
    )
    (bl.RESULTS / f"{a.out}.md").write_text(md + "\n")
    bl.write_json(f"{a.out}.json", data)
    print(f"wrote {bl.RESULTS / (a.out + '.md')}")


if __name__ == "__main__":
    main()

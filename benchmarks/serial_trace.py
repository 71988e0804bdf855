"""The serial path's syscalls: one request at a time through the sidecar and the bare relay.

    PYTHONPATH=. .venv/bin/python benchmarks/serial_trace.py [--requests 200] [--sse]

Starts ``benchmarks/upstream.py``, ``benchmarks/bare_relay.py`` and ``sidecar serve``
(the config of ``overhead.py``), warms each proxy up, then attaches ``strace -f``
to one proxy at a time while a closed-loop client on one keep-alive connection
sends ``--requests`` requests, one after the other (concurrency 1). Reports, per
request: syscalls by name, writes (``write``/``sendto``/``writev``/``sendmsg``)
and reads per socket side (client side: the proxy's accepted socket; upstream
side: its connection to the upstream), ``epoll_wait`` calls (event-loop turns
that waited), and the socket options the proxy set (``TCP_NODELAY``).

Deterministic counts, not timings: what the serial path does per request, for
``benchmarks/results/latency-c1.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl
from loadgen import DEFAULT_BODY
from overhead import SIDECAR_TOML

WRITES = {"write", "sendto", "writev", "sendmsg"}
READS = {"read", "recvfrom", "readv", "recvmsg"}
LINE = re.compile(r"^(?:\[pid\s+(\d+)\]\s+|(\d+)\s+)?(\w+)\((\d+)?(.*)$")


def request_bytes(port: int, stream: bool) -> bytes:
    body = DEFAULT_BODY if not stream else DEFAULT_BODY[:-1] + b', "stream": true}'
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer sk-bench\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (port, len(body), body)
    )


def read_response(sock: socket.socket) -> int:
    """Read one response (Content-Length or chunked) off ``sock``; return the recv calls."""
    buf = b""
    recvs = 0
    while b"\r\n\r\n" not in buf:
        got = sock.recv(65536)
        recvs += 1
        if not got:
            raise ConnectionError("closed")
        buf += got
    head, _, rest = buf.partition(b"\r\n\r\n")
    low = head.lower()
    if b"content-length:" in low:
        n = int(low.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        while len(rest) < n:
            got = sock.recv(65536)
            recvs += 1
            rest += got
        return recvs
    while not rest.endswith(b"0\r\n\r\n"):
        got = sock.recv(65536)
        recvs += 1
        if not got:
            raise ConnectionError("closed")
        rest += got
    return recvs


def drive(port: int, n: int, stream: bool) -> tuple[float, int]:
    """``n`` requests in a row on one connection; (seconds, client recv calls)."""
    req = request_bytes(port, stream)
    recvs = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        for _ in range(n):
            sock.sendall(req)
            recvs += read_response(sock)
        return time.perf_counter() - t0, recvs


def parse(path: Path, n: int) -> dict[str, Any]:
    """Per-request counts from an ``strace -f -tt`` log."""
    calls: collections.Counter[str] = collections.Counter()
    by_fd: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    sockopts: list[str] = []
    for line in path.read_text().splitlines():
        m = LINE.match(line)
        if not m or "resumed>" in line:
            continue
        name, fd = m.group(3), m.group(4)
        calls[name] += 1
        if fd is not None and (name in WRITES or name in READS):
            kind = "write" if name in WRITES else "read"
            by_fd[fd][kind] += 1
        if name == "setsockopt":
            sockopts.append(line.split("setsockopt", 1)[1][:80])
    per = {k: v / n for k, v in sorted(calls.items())}
    fds = {fd: {k: v / n for k, v in c.items()} for fd, c in by_fd.items()}
    return {"per_request": per, "by_fd": fds, "setsockopt": sockopts[:6]}


def trace(pid: int, port: int, n: int, stream: bool, wd: Path, name: str) -> dict[str, Any]:
    log = wd / f"strace-{name}.log"
    st = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", str(log), "-p", str(pid)],
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # strace attaches to every thread before the first request
    secs, recvs = drive(port, n, stream)
    st.terminate()
    st.wait(10)
    out = parse(log, n)
    out["client_recvs_per_request"] = recvs / n
    out["seconds_per_request_traced"] = secs / n
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--sse", action="store_true", help="SSE requests (20 events) instead of JSON")
    p.add_argument("--sse-gap-ms", type=float, default=0.0)
    p.add_argument("--keep", action="store_true", help="print the strace logs' paths; keep them")
    p.add_argument("--out", default=None, help="write the counts to results/<out>.json")
    args = p.parse_args()
    results: dict[str, Any] = {}
    with bl.workdir("bench-serial-") as wd, bl.Procs(wd) as procs:
        _, up = bl.start_upstream(procs, "upstream", "--sse-gap-ms", str(args.sse_gap_ms))
        bare_port = bl.free_port()
        bare = procs.start(
            "bare-relay",
            [bl.PY, str(bl.HERE / "bare_relay.py"), "--port", str(bare_port),
             "--upstream", f"http://127.0.0.1:{up}"],
        )  # fmt: skip
        bl.wait_port(bare_port, bare)
        sc_port, admin = bl.free_port(), bl.free_port()
        config = bl.write_sidecar_config(
            wd / "sidecar.toml", SIDECAR_TOML.format(up=up), listen=sc_port, admin=admin,
            log_level="info",
        )  # fmt: skip
        sc = bl.start_sidecar(procs, "sidecar", config)
        for name, port, pid in (("bare relay", bare_port, bare.pid),
                                ("sidecar", sc_port, sc.pid)):  # fmt: skip
            drive(port, 200, args.sse)  # warm-up
            results[name] = trace(pid, port, args.requests, args.sse, wd, name.replace(" ", "-"))
            if args.keep:
                keep = Path("/tmp") / f"strace-{name.replace(' ', '-')}.log"
                keep.write_text((wd / f"strace-{name.replace(' ', '-')}.log").read_text())
                print(f"kept {keep}")
    print(json.dumps(results, indent=1))
    if args.out:
        bl.write_json(f"{args.out}.json", {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

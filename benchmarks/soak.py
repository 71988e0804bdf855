"""Soak: many mixed requests through a real ``sidecar serve``; nothing may grow with the count.

    .venv/bin/python benchmarks/soak.py [--requests 100000] [--concurrency 32]

The sidecar runs as a child process (``sidecar serve --config <tmp toml>``, the
real command line, on 127.0.0.1) in front of the package's fault-injecting
:class:`~sidecar.testing.FakeUpstream`, which runs in this process with the
traffic driver. Each request picks its behaviour by its number (:data:`KINDS`):
JSON and SSE successes, upstream 503s (fallback, then relayed), connection
resets before the answer (502) and mid-stream (cut stream), clients that go away
mid-stream or before the answer, a route whose only candidate's breaker opens
and closes again (primary: ``failure_threshold`` 3, ``cooldown_ms`` 100), 413s
and 400s. Faults travel in the ``x-fake-fault`` request header, so concurrent
requests never race for a shared script.

At :option:`--checkpoints` points the load pauses, the client session is closed
(so the sidecar holds no client connection), the fake's handlers are left to
end, and the sidecar is measured: RSS (``/proc/PID/status``), open fds
(``/proc/PID/fd``), asyncio tasks, and its upstream connections (counted by the
fake). The first checkpoint is the baseline (after the warm-up); the run fails
(exit 1) when, at the last checkpoint:

* tasks differ from the baseline (each checkpoint has no client connection, so
  the count is exact);
* fds minus upstream connections (each pooled upstream connection is one fd)
  exceed the baseline by more than 2;
* upstream connections exceed what the pool bound allows
  (``2 x --concurrency``: two upstream names point at the fake);
* RSS exceeds the baseline by more than ``max(10 MiB, 10 %)``; its slope over the
  checkpoints is reported too;
* any request ended in an outcome its kind does not allow.

How the task count is read with no product change: the child is started as
``python -c <bootstrap> serve --config ...``, a bootstrap that installs a
``SIGUSR1`` handler and then calls ``sidecar.cli.main`` (so everything else is
exactly ``sidecar serve``). The handler, which Python runs on the main thread
between two bytecodes of the running event loop, writes
``{"soak_probe": {"tasks": len(asyncio.all_tasks())}}`` to stderr. Running the
sidecar in-process instead would hide its RSS and fds among the driver's and
the fake's; adding a ``tasks`` field to ``/status`` would change the contract
for a benchmark's sake.

Writes ``benchmarks/results/soak.md`` (and ``soak.json``). The reduced form that
runs in CI is ``tests/e2e/test_soak_small.py`` (2,000 requests, in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.testing import FAULT_HEADER, FakeUpstream

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
LIMIT = 4096
"""``max_request_body_bytes`` of the soak config."""

KINDS: tuple[str, ...] = (
    "json",
    "stream",
    "json",
    "upstream_503",
    "reset",
    "json",
    "stream_cut",
    "client_gone_stream",
    "client_gone_early",
    "solo",
    "stream",
    "too_large",
    "not_json",
    "solo",
)
"""Request ``i`` does ``KINDS[i % len(KINDS)]``."""

ALLOWED: dict[str, frozenset[str]] = {
    "json": frozenset({"200"}),
    "stream": frozenset({"200"}),
    "upstream_503": frozenset({"503"}),
    "reset": frozenset({"502"}),
    "stream_cut": frozenset({"cut"}),
    "client_gone_stream": frozenset({"gone"}),
    "client_gone_early": frozenset({"gone", "200"}),
    "solo": frozenset({"200", "503", "502"}),
    "too_large": frozenset({"413"}),
    "not_json": frozenset({"400"}),
}
"""Outcomes each kind may end in (``cut``: payload error after a 200; ``gone``: we left)."""

FAULTS: dict[str, dict[str, Any]] = {
    "upstream_503": {"status": 503},
    "reset": {"reset_before_headers": True},
    "stream_cut": {"reset_after_chunks": 2},
    "client_gone_stream": {"chunks": 10, "chunk_delay_ms": 20},
    "client_gone_early": {"delay_headers_ms": 30},
    "solo": {},
}


def config_toml(url: str, *, listen: str = "127.0.0.1:0", admin: str = "127.0.0.1:0") -> str:
    """The soak config: two upstream names on the fake, a breaker that cycles, small limits."""
    return f"""
[server]
listen = "{listen}"
admin_listen = "{admin}"
max_request_body_bytes = {LIMIT}
request_timeout_ms = 10000
drain_timeout_ms = 1000
client_read_timeout_ms = 5000
log_level = "info"

[upstreams.primary]
base_url = "{url}"
first_byte_timeout_ms = 5000
[upstreams.primary.retry]
max_retries = 0
[upstreams.primary.circuit_breaker]
failure_threshold = 3
cooldown_ms = 100

[upstreams.backup]
base_url = "{url}"
[upstreams.backup.retry]
max_retries = 0

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{{ upstream = "primary" }}, {{ upstream = "backup" }}]
[[routes]]
name = "solo"
path_prefix = "/solo/"
candidates = [{{ upstream = "primary" }}]
[[routes]]
name = "strict"
path_prefix = "/strict/"
models = ["gpt-4o"]
candidates = [{{ upstream = "backup" }}]
"""


async def one_request(http: aiohttp.ClientSession, base: str, i: int) -> tuple[str, str]:
    """Send request ``i`` of the mix; return ``(kind, outcome)``."""
    kind = KINDS[i % len(KINDS)]
    headers = {FAULT_HEADER: json.dumps(FAULTS[kind])} if kind in FAULTS else {}
    if kind == "solo":
        # Every third solo request fails, so the primary's breaker opens and recovers.
        headers = {FAULT_HEADER: json.dumps({"status": 503})} if i % 3 == 0 else {}
    path = {"solo": "/solo/chat/completions", "not_json": "/strict/x"}.get(
        kind, "/v1/chat/completions"
    )
    stream = kind in ("stream", "stream_cut", "client_gone_stream")
    body: Any = {"model": "gpt-4o", "stream": stream}
    data: bytes | None = None
    if kind == "too_large":
        data = b'{"model": "gpt-4o", "pad": "' + b"x" * LIMIT + b'"}'
    elif kind == "not_json":
        data = b"not json"
    kwargs: dict[str, Any] = {"data": data} if data is not None else {"json": body}
    if kind == "client_gone_early":
        try:
            async with asyncio.timeout(0.005):
                async with http.post(base + path, headers=headers, **kwargs) as r:
                    await r.read()
                    return kind, str(r.status)
        except TimeoutError:
            return kind, "gone"
    async with http.post(base + path, headers=headers, **kwargs) as r:
        if kind == "client_gone_stream":
            await r.content.readany()
            r.close()  # drop the connection mid-stream
            return kind, "gone"
        try:
            await r.read()
        except aiohttp.ClientPayloadError:
            return kind, "cut"
        return kind, str(r.status)


async def drive(base: str, numbers: Iterable[int], concurrency: int) -> collections.Counter[str]:
    """Send requests ``numbers`` to ``base`` with ``concurrency`` workers over one session,
    closed at the end (so no client connection stays open); count ``kind:outcome``."""
    counts: collections.Counter[str] = collections.Counter()
    todo = iter(numbers)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as http:

        async def worker() -> None:
            for i in todo:
                try:
                    kind, outcome = await one_request(http, base, i)
                except aiohttp.ClientError as exc:
                    kind, outcome = KINDS[i % len(KINDS)], type(exc).__name__
                counts[f"{kind}:{outcome}"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


def unexpected(counts: collections.Counter[str]) -> dict[str, int]:
    """The ``kind:outcome`` entries of ``counts`` that :data:`ALLOWED` does not allow."""
    out = {}
    for key, n in counts.items():
        kind, outcome = key.split(":", 1)
        if outcome not in ALLOWED[kind]:
            out[key] = n
    return out


# -- the child: ``sidecar serve`` plus a task-count probe -------------------------------

BOOTSTRAP = """
import asyncio, json, signal, sys

def _probe(signum, frame):
    loop = asyncio.get_running_loop()
    sys.stderr.write(json.dumps({"soak_probe": {"tasks": len(asyncio.all_tasks(loop))}}) + "\\n")
    sys.stderr.flush()

signal.signal(signal.SIGUSR1, _probe)
from sidecar.cli import main
sys.exit(main(sys.argv[1:]))
"""


class Child:
    """The ``sidecar serve`` child: its ports, its log lines, its probe answers."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.proxy_port = 0
        self.admin_port = 0
        self.logs: list[str] = []
        """Log lines at level error or above, and any line that is not JSON (first 200)."""
        self.events: collections.Counter[str] = collections.Counter()
        self.probes: list[int] = []
        self.started = asyncio.Event()
        self._probe_seen = asyncio.Event()
        assert proc.stdout is not None and proc.stderr is not None
        self.readers = [
            asyncio.create_task(self._read(proc.stdout)),
            asyncio.create_task(self._read(proc.stderr)),
        ]

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            text = line.decode(errors="replace").strip()
            try:
                doc = json.loads(text)
            except ValueError:
                doc = None
            if isinstance(doc, dict) and "soak_probe" in doc:
                self.probes.append(int(doc["soak_probe"]["tasks"]))
                self._probe_seen.set()
                continue
            problem = not isinstance(doc, dict) or doc.get("level") in ("error", "critical")
            if problem and len(self.logs) < 200:
                self.logs.append(text)
            if isinstance(doc, dict):
                self.events[str(doc.get("event"))] += 1
            if isinstance(doc, dict) and doc.get("event") == "started":
                self.proxy_port, self.admin_port = doc["proxy_port"], doc["admin_port"]
                self.started.set()

    async def tasks(self) -> int:
        """Ask the child for its asyncio task count (SIGUSR1, answer on stderr)."""
        self._probe_seen.clear()
        self.proc.send_signal(signal.SIGUSR1)
        async with asyncio.timeout(5):
            await self._probe_seen.wait()
        return self.probes[-1]

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


async def start_child(config: Path) -> Child:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        BOOTSTRAP,
        "serve",
        "--config",
        str(config),
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("SIDECAR")},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    child = Child(proc)
    try:
        async with asyncio.timeout(20):
            await child.started.wait()
    except TimeoutError:
        proc.kill()
        raise RuntimeError(f"sidecar did not start: {child.logs[-5:]}") from None
    return child


# -- the run ------------------------------------------------------------------------------


async def quiesce(fake: FakeUpstream, child: Child) -> int:
    """Wait until the fake runs no handler and the child's task count is steady; return it."""
    async with asyncio.timeout(10):
        await fake.wait_until(lambda: fake.active_requests == 0)
    last = await child.tasks()
    for _ in range(40):  # bounded: at most ~2 s
        await asyncio.sleep(0.05)
        now = await child.tasks()
        if now == last:
            return now
        last = now
    return last


async def soak(requests: int, concurrency: int, checkpoints: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    counts: collections.Counter[str] = collections.Counter()
    async with FakeUpstream(record_requests=False) as fake:
        with tempfile.TemporaryDirectory(prefix="sidecar-soak-") as tmp:
            path = Path(tmp) / "sidecar.toml"
            path.write_text(config_toml(fake.url))
            child = await start_child(path)
            try:
                base = f"http://127.0.0.1:{child.proxy_port}"
                step = max(1, requests // checkpoints)
                started = time.perf_counter()
                done = 0
                while done < requests:
                    n = min(step, requests - done)
                    counts += await drive(base, range(done, done + n), concurrency)
                    done += n
                    tasks = await quiesce(fake, child)
                    row = {
                        "requests": done,
                        "seconds": time.perf_counter() - started,
                        "rss_mib": child.rss_mib(),
                        "fds": child.fds(),
                        "upstream_conns": fake.open_connections,
                        "tasks": tasks,
                    }
                    row["fds_minus_upstream"] = row["fds"] - row["upstream_conns"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                child.proc.send_signal(signal.SIGTERM)
                async with asyncio.timeout(15):
                    exit_code = await child.proc.wait()
                    await asyncio.gather(*child.readers)
            finally:
                if child.proc.returncode is None:
                    child.proc.kill()
                    await child.proc.wait()
    return {
        "requests": requests,
        "concurrency": concurrency,
        "rows": rows,
        "counts": dict(sorted(counts.items())),
        "exit_code": exit_code,
        "fake_requests": fake.request_count,
        "error_logs": child.logs[:20],
        "log_events": dict(child.events.most_common()),
    }


def slope_per_10k(rows: list[dict[str, Any]], key: str) -> float:
    """Least-squares slope of ``key`` against the request count, per 10,000 requests."""
    xs = [r["requests"] for r in rows]
    ys = [r[key] for r in rows]
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return (
        0.0
        if var == 0
        else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var * 10_000
    )


def verdicts(result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for each growth and correctness check."""
    rows = result["rows"]
    base, last = rows[0], rows[-1]
    rss_allow = max(10.0, base["rss_mib"] * 0.10)
    pool_bound = 2 * result["concurrency"]
    bad = unexpected(collections.Counter(result["counts"]))
    return [
        (
            "asyncio tasks back to the baseline",
            last["tasks"] == base["tasks"],
            f"{base['tasks']} -> {last['tasks']} (max {max(r['tasks'] for r in rows)})",
        ),
        (
            "fds (minus upstream connections) not growing",
            last["fds_minus_upstream"] <= base["fds_minus_upstream"] + 2,
            f"{base['fds_minus_upstream']} -> {last['fds_minus_upstream']}",
        ),
        (
            "upstream connections within the pool bound",
            max(r["upstream_conns"] for r in rows) <= pool_bound,
            f"max {max(r['upstream_conns'] for r in rows)} <= {pool_bound}",
        ),
        (
            "RSS not growing",
            last["rss_mib"] <= base["rss_mib"] + rss_allow,
            f"{base['rss_mib']:.1f} -> {last['rss_mib']:.1f} MiB (allowed +{rss_allow:.1f}); "
            f"slope {slope_per_10k(rows[1:] or rows, 'rss_mib'):+.2f} MiB per 10k requests",
        ),
        ("every outcome allowed for its kind", not bad, json.dumps(bad) if bad else "all"),
        ("clean exit on SIGTERM", result["exit_code"] == 0, f"exit {result['exit_code']}"),
    ]


def machine_md() -> str:
    """The machine, as the other benchmarks report it (``benchlib.machine``), or ``""``."""
    sys.path.insert(0, str(HERE))
    try:
        bl = importlib.import_module("benchlib")
        return str(bl.machine_md(bl.machine()))
    except Exception:  # the report is still useful without it
        return ""
    finally:
        sys.path.remove(str(HERE))


def report(result: dict[str, Any], checks: list[tuple[str, bool, str]], cmd: str) -> str:
    rows = result["rows"]
    lines = [
        "# Soak: mixed traffic through `sidecar serve`",
        "",
        f"Command: `{cmd}`",
        "",
        machine_md(),
        "",
        f"{result['requests']:,} requests, concurrency {result['concurrency']}, "
        f"{rows[-1]['seconds']:.0f} s ({result['requests'] / rows[-1]['seconds']:,.0f} req/s); "
        f"the fake upstream read {result['fake_requests']:,} requests. "
        "Measured at each checkpoint with no client connection open and no upstream "
        "handler running (see `benchmarks/soak.py` for the method). The first row is the baseline.",
        "",
        "| requests | RSS MiB | fds | upstream conns | fds - upstream | asyncio tasks |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['requests']:,} | {r['rss_mib']:.1f} | {r['fds']} | {r['upstream_conns']} "
            f"| {r['fds_minus_upstream']} | {r['tasks']} |"
        )
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    lines += [
        f"| {name} | {'pass' if ok else '**FAIL**'} | {detail} |" for name, ok, detail in checks
    ]
    lines += ["", "Outcomes (`kind:outcome`: count):", ""]
    lines += [f"- `{k}`: {v:,}" for k, v in result["counts"].items()]
    lines += ["", "Log events of the sidecar (`event`: count):", ""]
    lines += [f"- `{k}`: {v:,}" for k, v in result["log_events"].items()]
    if result["error_logs"]:
        lines += ["", "Error log lines (first 20):", ""]
        lines += [f"    {line}" for line in result["error_logs"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.md")
    args = ap.parse_args(argv)
    if args.requests < args.checkpoints or args.checkpoints < 2:
        ap.error("need --checkpoints >= 2 and --requests >= --checkpoints")
    result = asyncio.run(soak(args.requests, args.concurrency, args.checkpoints))
    checks = verdicts(result)
    cmd = " ".join(
        [os.path.relpath(sys.executable, ROOT), "benchmarks/soak.py", *(argv or sys.argv[1:])]
    )
    text = report(result, checks, cmd)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    with contextlib.suppress(OSError):
        args.out.with_suffix(".json").write_text(json.dumps({**result, "checks": checks}, indent=1))
    print(text)
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

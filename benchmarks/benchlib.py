"""Shared plumbing of the benchmarks: processes, ports, /proc readings, reports.

Everything here runs on loopback (127.0.0.1) only. Every process a benchmark
starts goes through :class:`Procs`, which stops them all (SIGTERM, then SIGKILL)
when the ``with`` block ends, on errors and on Ctrl-C or SIGTERM too; each child
also gets SIGTERM from the kernel if the benchmark process itself dies
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
VENV_BIN = Path(sys.executable).parent
PY = sys.executable
LOOPBACK = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- processes -----------------------------------------------------------------------


def _die_with_parent() -> None:  # pragma: no cover (runs in the child)
    """preexec_fn: SIGTERM this child when the benchmark process dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Proc:
    """One child process (see :class:`Procs`)."""

    def __init__(self, name: str, popen: subprocess.Popen[Any], log: Path | None) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, line: str) -> str:
        """Write a control line to the child's stdin and read one reply line."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        reply: str = self.popen.stdout.readline()
        if not reply:
            raise RuntimeError(f"{self.name} exited (control: {line!r})")
        return reply.strip()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. Returns the exit code."""
        p = self.popen
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(5)
        for f in (p.stdin, p.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        return p.returncode


class Procs(contextlib.AbstractContextManager["Procs"]):
    """Starts children and stops every one of them on exit (reverse start order)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []
        self._old_term: Any = None

    def __enter__(self) -> Procs:
        def on_term(signum: int, frame: object) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        self._old_term = signal.signal(signal.SIGTERM, on_term)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        signal.signal(signal.SIGTERM, self._old_term)

    def stop_all(self) -> None:
        while self.procs:
            self.procs.pop().stop()

    def stop(self, proc: Proc) -> int | None:
        if proc in self.procs:
            self.procs.remove(proc)
        return proc.stop()

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        control: bool = False,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Proc:
        """Start ``cmd`` in ``cwd`` (default: the repo root); its output goes to
        ``<workdir>/<name>.log`` unless ``control`` (then stdin/stdout are pipes for
        :meth:`Proc.send`, stderr goes to the log)."""
        log = self.workdir / f"{name}.log"
        out: IO[Any] = open(log, "ab")  # noqa: SIM115 (the child keeps it)
        try:
            popen = subprocess.Popen(
                list(cmd),
                stdin=subprocess.PIPE if control else subprocess.DEVNULL,
                stdout=subprocess.PIPE if control else out,
                stderr=out,
                text=control,
                bufsize=1 if control else -1,
                env={**os.environ, **(env or {})},
                preexec_fn=_die_with_parent,
                cwd=cwd or ROOT,
            )
        finally:
            out.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc


def free_port() -> int:
    """A loopback port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
    return port


def wait_port(port: int, proc: Proc | None = None, timeout: float = 20.0) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited early; see {proc.log}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """A tiny blocking HTTP/1.0 GET on loopback: (status, body)."""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {LOOPBACK}\r\n\r\n".encode())
        chunks = []
        while data := s.recv(65536):
            chunks.append(data)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def raise_fd_limit() -> int:
    """Raise this process's (and so its children's) open-file soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# -- upstream and sidecar helpers ----------------------------------------------------------


def start_upstream(procs: Procs, name: str, *args: str, port: int = 0) -> tuple[Proc, int]:
    """Start ``benchmarks/upstream.py`` (controlled through stdin) and return it and its port."""
    proc = procs.start(
        name, [PY, str(HERE / "upstream.py"), "--port", str(port), *args], control=True
    )
    assert proc.popen.stdout is not None
    line = proc.popen.stdout.readline().strip()
    if not line.startswith("listening "):
        raise RuntimeError(f"{name} did not start: {line!r}; see {proc.log}")
    return proc, int(line.split()[1])


def upstream_stats(proc: Proc) -> dict[str, Any]:
    stats: dict[str, Any] = json.loads(proc.send("stats"))
    return stats


def write_sidecar_config(
    path: Path, body: str, *, listen: int, admin: int, log_level: str = "warning"
) -> Path:
    """Write a sidecar TOML: ``[server]`` on loopback ports, ``log_level``, then ``body``."""
    path.write_text(
        "[server]\n"
        f'listen = "{LOOPBACK}:{listen}"\n'
        f'admin_listen = "{LOOPBACK}:{admin}"\n'
        f'log_level = "{log_level}"\n' + body
    )
    return path


def start_sidecar(procs: Procs, name: str, config: Path) -> Proc:
    """``sidecar serve --config <config>``; waits for ``/readyz`` 200."""
    cmd = [str(VENV_BIN / "sidecar"), "serve", "--config", str(config)]
    proc = procs.start(name, cmd)
    text = config.read_text()
    admin = int(text.split("admin_listen", 1)[1].split('"')[1].rsplit(":", 1)[1])
    deadline = time.monotonic() + 20
    while True:
        if not proc.alive():
            raise RuntimeError(f"{name} exited early; see {proc.log}")
        with contextlib.suppress(OSError):
            if http_get(admin, "/readyz")[0] == 200:
                return proc
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready; see {proc.log}")
        time.sleep(0.05)


def metric_sum(admin_port: int, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    _, body = http_get(admin_port, "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric, _, rest = key.partition("{")
        if metric != name:
            continue
        pairs = dict(
            p.split("=", 1) for p in rest.rstrip("}").split(",") if "=" in p
        )  # values keep their quotes
        if all(pairs.get(k) == f'"{v}"' for k, v in labels.items()):
            total += float(value)
    return total


# -- /proc readings ------------------------------------------------------------------------


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux /proc children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
    return out


def cpu_seconds(pid: int, tree: bool = False) -> float:
    """utime + stime of ``pid`` (all its threads), or of its whole process tree."""
    total = 0
    for p in tree_pids(pid) if tree else [pid]:
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / CLK_TCK


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def rss_mib(pid: int, tree: bool = False) -> float:
    """Current resident set (VmRSS), MiB, summed over the tree when asked."""
    pids = tree_pids(pid) if tree else [pid]
    return sum(_status_kib(p, "VmRSS") for p in pids) / 1024


def hwm_mib(pid: int, tree: bool = False) -> float:
    """Peak resident set (VmHWM), MiB, summed over the tree when asked."""
    pids = tree_pids(pid) if tree else [pid]
    return sum(_status_kib(p, "VmHWM") for p in pids) / 1024


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets ``pid`` holds open."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    return out


TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def tcp_states(pid: int) -> dict[str, int]:
    """TCP sockets held by ``pid`` counted by state (from /proc/net/tcp)."""
    inodes = socket_inodes(pid)
    counts: dict[str, int] = {}
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            if int(parts[9]) in inodes:
                state = TCP_STATES.get(parts[3], parts[3])
                counts[state] = counts.get(state, 0) + 1
    return counts


def system_busy_seconds() -> float:
    """CPU seconds all CPUs spent busy since boot (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK


class ForeignCpu:
    """CPU used on the machine by processes *other* than the benchmark's own during a window.

    ``own`` gives the CPU seconds of the long-lived children measured (proxy,
    upstream); waited-for children (wrk, loadgen.py) and this process are
    counted through ``getrusage``. The rest is other people's work on this
    shared machine: a noise indicator, in cores.
    """

    def __init__(self, own: Callable[[], float]) -> None:
        self.own = own
        self.t0 = time.monotonic()
        self.busy0 = system_busy_seconds()
        self.own0 = own() + self._rusage()

    @staticmethod
    def _rusage() -> float:
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        s = resource.getrusage(resource.RUSAGE_SELF)
        return c.ru_utime + c.ru_stime + s.ru_utime + s.ru_stime

    def cores(self) -> float:
        wall = time.monotonic() - self.t0
        busy = system_busy_seconds() - self.busy0
        own = self.own() + self._rusage() - self.own0
        return max(0.0, (busy - own) / wall) if wall > 0 else float("nan")


def git_state(root: Path = ROOT) -> str:
    """HEAD commit of the checkout ``root`` and the number of files changed under its
    sidecar/ (read-only git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "sidecar"],
            capture_output=True,
            text=True,
            cwd=root,
        ).stdout.splitlines()
    except OSError:
        return "?"
    return f"{head}" + (f" + {len(dirty)} uncommitted file(s) in sidecar/" if dirty else "")


# -- statistics ----------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]  # drop NaN
    return statistics.median(vals) if vals else float("nan")


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (NaN when empty)."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


# -- tools -----------------------------------------------------------------------------------


def apt_install(binary: str, package: str) -> str | None:
    """Path of ``binary``, installing Debian ``package`` when missing (root only).

    Returns None (and prints why) when it cannot be had.
    """
    found = _which(binary)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print(f"note: {binary} not found and cannot apt-get install {package} here")
        return None
    print(f"installing {package} from Debian (apt-get) ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Keep the package's own service (nginx on 0.0.0.0:80) from being started by
    # the install: policy-rc.d exit 101 = "not allowed" (Debian's invoke-rc.d policy).
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        for cmd in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
        ):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                print(f"note: {' '.join(cmd)} failed: {r.stderr.strip()[-300:]}")
                return None
    finally:
        if ours:
            policy.unlink(missing_ok=True)
    return _which(binary)


def _which(binary: str) -> str | None:
    found = shutil.which(binary)
    if found is None and Path(f"/usr/sbin/{binary}").exists():
        found = f"/usr/sbin/{binary}"
    return found


def pip_install(module: str, requirement: str) -> bool:
    """Import ``module``, pip-installing ``requirement`` into this venv when missing."""
    try:
        __import__(module)
        return True
    except ImportError:
        pass
    print(f"installing {requirement} into {sys.prefix} (pip) ...", flush=True)
    r = subprocess.run(
        [PY, "-m", "pip", "install", "-q", requirement], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        print(f"note: pip install {requirement} failed: {r.stderr.strip()[-300:]}")
        return False
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def matplotlib_pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend (installed into the venv if missing), or None."""
    if not pip_install("matplotlib", "matplotlib>=3.8"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- reports -------------------------------------------------------------------------------


def _version(cmd: Sequence[str]) -> str:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "not found"
    out = (r.stdout + r.stderr).strip().splitlines()
    return out[0] if out else "?"


def machine() -> dict[str, str]:
    """nproc, CPU model, kernel, Python, library versions, load average at start."""
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem = f"{int(f.readline().split()[1]) / 1024 / 1024:.1f} GiB"
    from importlib.metadata import version

    libs = ", ".join(
        f"{m} {version(m)}" for m in ("aiohttp", "aiohttp-retry", "prometheus-client", "multidict")
    )
    try:
        libs += f", uvloop {version('uvloop')} (the sidecar and the Python relays run on it)"
    except Exception:
        libs += ", no uvloop (asyncio's loop everywhere)"
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version() + f" ({platform.python_implementation()})",
        "libraries": libs,
        "sidecar code": f"{git_state()} (checkout {ROOT})",
        "loadavg at start": loadavg(),
    }


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (``uptime``'s), e.g. ``"1.92 1.40 0.88"``."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


MACHINE_ORDER = (
    "nproc",
    "cpu",
    "memory",
    "kernel",
    "python",
    "libraries",
    "sidecar code",
    "loadavg at start",
    "loadavg at end",
)


def machine_md(info: dict[str, str], extra: dict[str, str] | None = None) -> str:
    ordered = {k: info[k] for k in MACHINE_ORDER if k in info}
    rows = {**ordered, **{k: v for k, v in info.items() if k not in ordered}, **(extra or {})}
    return "\n".join(f"- **{k}**: {v}" for k, v in rows.items())


def command_line() -> str:
    """The exact command that ran this benchmark, relative to the repo root."""
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else PY
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return shlex.join([exe, script, *sys.argv[1:]])


def sidecar_config_md(sample: str) -> list[str]:
    """Report lines showing a run's sidecar config: the ``[server]`` table the run
    writes (ports chosen at start, ``log_level = "warning"``), then ``sample``."""
    return [
        "```toml",
        "[server]",
        'listen = "127.0.0.1:<free port>"',
        'admin_listen = "127.0.0.1:<free port>"',
        'log_level = "warning"',
        sample.strip(),
        "```",
    ]


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            if v != v:
                return "-"
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(name: str, data: Any) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    return path


def read_json(name: str) -> Any:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


@contextlib.contextmanager
def workdir(prefix: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        yield Path(d)


Scenario = Callable[["Procs", Path, argparse.Namespace], Any]
"""One scenario of a multi-scenario benchmark: (processes, work dir, args) -> results."""


def run_scenarios(
    name: str, stem: str, args: argparse.Namespace, runners: dict[str, Scenario], chosen: list[str]
) -> dict[str, Any]:
    """Run the ``chosen`` scenarios of ``runners`` in one work dir (``bench-NAME-``) and
    write ``results/STEM.json`` (command, machine, args, each scenario's results and
    ``took_min``); returns the results."""
    raise_fd_limit()
    info = machine()
    started = time.monotonic()
    results: dict[str, Any] = {}
    with workdir(f"bench-{name}-") as wd, Procs(wd) as procs:
        for s in chosen:
            results[s] = runners[s](procs, wd, args)
    results["took_min"] = (time.monotonic() - started) / 60
    info["loadavg at end"] = loadavg()
    write_json(
        f"{stem}.json",
        {"command": command_line(), "machine": info, "args": vars(args), "results": results},
    )
    return results


def scenario_outputs(
    stem: str,
    chart_name: str,
    report: Callable[[argparse.Namespace, dict[str, str], dict[str, Any], str], str],
    chart: Callable[[Path, argparse.Namespace, dict[str, Any]], bool],
) -> str:
    """``STEM.md`` and ``STEM.png`` from ``STEM.json`` (a run's, or an earlier one's):
    ``report`` renders the markdown (its image link ``(CHART_NAME)`` renamed to
    ``STEM.png``), ``chart`` draws the PNG (False: matplotlib unavailable)."""
    data = read_json(f"{stem}.json")
    args = argparse.Namespace(**data["args"])
    md = report(args, data["machine"], data["results"], data["command"])
    md = md.replace(f"({chart_name})", f"({stem}.png)")
    (RESULTS / f"{stem}.md").write_text(md)
    if not chart(RESULTS / f"{stem}.png", args, data["results"]):
        print("note: no chart (matplotlib unavailable)")
    return md


def run_json_tool(cmd: Sequence[str], timeout: float, marker: str = "") -> dict[str, Any]:
    """Run a tool that prints one JSON line (after ``marker``); return it parsed."""
    r = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
    )
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(marker) and line[len(marker) :].lstrip().startswith("{"):
            data: dict[str, Any] = json.loads(line[len(marker) :])
            return data
    raise RuntimeError(
        f"{cmd[0]} printed no result (rc {r.returncode}): {r.stdout[-500:]} {r.stderr[-500:]}"
    )


def fmt_s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


ProgressFn = Callable[[str], None]


def progress(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)

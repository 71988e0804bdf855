"""SIGTERM always ends a fleet member within ``drain_timeout_ms`` + 1 s, whatever the store does.

Contract, "Shutdown": the process has exited within ``drain_timeout_ms`` + 1 s of the
SIGTERM whatever its upstreams and the fleet's store do (a store that is slow, paused or
gone never holds the exit). Issue #21 item 5: one member in about 25 stayed up 12 s
after ``draining`` with nothing in flight.

A loop of rounds, each a fleet of three real ``sidecar serve`` children (tests/serve_proc.py)
sharing one private ``redis-server`` (tests/redis_proc.py), with a fake upstream in this
process as both the primary and the backup. Each round sends traffic through every
member (answers, 503s that open breakers and make probes take the fleet's lease, so the
store is written), leaves work in flight at the fake (a stalled stream, a stalled JSON
answer, a slow stream) and keeps a steady request loop running on each member; then it
SIGTERMs the three at once or one after the other and times, per process, the signal to
its exit. The store in a round is one of:

- ``up``: every member synced and subscribed to the store's channel;
- ``slow``: a TCP proxy in this process between the members and Redis delays every
  forwarded chunk by 300-800 ms (syncs time out or crawl; some are in flight);
- ``paused``: SIGSTOP on redis-server (connections open, nothing answers), SIGCONT after;
- ``gone``: redis-server killed.

The sync interval is mostly 5 ms, else 100 or 1000 ms. The exit that was held (before
the stop was bounded): the fleet's sync task, cancelled by ``Fleet.stop`` while redis-py
sent a command through ``asyncio.wait_for`` (``Connection.send_packed_command``), lost
that cancellation in Python 3.11's ``wait_for`` race (CPython gh-86296: the inner send
had just finished), went on syncing every interval, and ``Fleet.stop`` awaited it for
ever. A short interval keeps a store round trip under way at the stop, so the loop
meets that race far more often than a production interval would.

Every exit must take at most ``drain_timeout_ms`` + 1000 ms and end with code 0; a
failure names each late member with its last log lines (``stop_step_timeout`` and
``exit_forced`` name what held it) and, for one still running a second past the bound,
its Python stacks when ``py-spy`` is installed. Every wait is on an observable event and
bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.testing import FAULT_HEADER, FakeUpstream
from tests.fleet_helpers import chain_config, needs_redis, until
from tests.redis_proc import RedisProc
from tests.serve_proc import ServeProc, child_env

DRAIN_MS = 400
BOUND_S = (DRAIN_MS + 1000) / 1000
"""The contract's bound on the time from SIGTERM to the process's exit."""
ROUNDS = 20
MEMBERS = 3
CONDITIONS = ("up", "slow", "paused", "gone")
SYNC_MS = (5, 100, 5, 1000)
"""``fleet.sync_interval_ms`` of the rounds, by cycle of the conditions."""
SLOW_DELAY_S = (0.3, 0.8)
"""The slow store: each chunk forwarded either way waits this long (uniform)."""
EXIT_LIMIT_S = BOUND_S + 4.0
"""How long a late member is waited for before it is killed (its report says so)."""
REQUEST_S = 5.0
WAIT_S = 15.0
CHANNEL = "sidecar:changes"

# Faults sent in the x-fake-fault header (the fake answers each request as it says).
QUICK = {"chunks": 1}
FAILING = {"status": 503}
STALLED_STREAM = {"stall_after_chunks": 1}  # one event relayed, then nothing until the end
STALLED_JSON = {"stall": True}  # headers sent, no body byte
SLOW_STREAM = {"chunks": 8, "chunk_delay_ms": 80}  # about 0.6 s: may end within the drain
IN_FLIGHT = (STALLED_STREAM, STALLED_JSON, SLOW_STREAM)

SHUTDOWN_EVENTS = (
    '"event":"draining"',
    '"event":"drain_timeout"',
    '"event":"stop_step_timeout"',
    '"event":"stop_step_failed"',
    '"event":"exit_forced"',
    '"event":"stopped"',
)
"""Log lines a report always shows (with the last lines of the member's output)."""

pytestmark = [needs_redis]


# -- the slow store ----------------------------------------------------------------------------


class SlowProxy:
    """A TCP proxy on loopback to ``127.0.0.1:target_port`` that delays every chunk it
    forwards (either way) by a random time in :data:`SLOW_DELAY_S`, in order."""

    def __init__(self, target_port: int, rng: random.Random) -> None:
        self.target_port = target_port
        self.rng = rng
        self.port = 0
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> SlowProxy:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.gather(*pumps, return_exceptions=True)  # cancelled at close()
        finally:
            self._tasks.difference_update(pumps)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await asyncio.sleep(self.rng.uniform(*SLOW_DELAY_S))  # the fault itself
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# -- one round ---------------------------------------------------------------------------------


@dataclass
class Round:
    number: int
    condition: str
    mode: str  # "together": three SIGTERMs at once; "staggered": one exit after another
    sync_ms: int
    notice: bool  # paused/gone: wait until every member sees the store down first


@dataclass
class Exit:
    """One member's SIGTERM: when it was sent (UTC, as the log's ``ts``), how long to the
    exit, the exit code, the member's output and, when it held its exit, its stacks."""

    round: Round
    member: str
    signalled: str
    seconds: float
    code: int | None
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    dump: list[str] = field(default_factory=list)

    def late(self) -> bool:
        return self.seconds > BOUND_S or self.code != 0

    def inflight_at_drain(self) -> int:
        """``inflight`` of the member's ``draining`` line (-1 without one)."""
        for line in self.stdout:
            if '"event":"draining"' in line:
                return int(json.loads(line)["inflight"])
        return -1

    def report(self) -> str:
        r = self.round
        head = (
            f"round {r.number} (store {r.condition}, {r.mode}, sync_interval_ms {r.sync_ms}) "
            f"{self.member}: SIGTERM at {self.signalled}, "
            + (
                f"still running after {self.seconds:.3f} s (killed)"
                if self.code is None
                else f"exit {self.code} after {self.seconds:.3f} s"
            )
            + f" (bound {BOUND_S:.1f} s)"
        )
        shown = [line for line in self.stdout if any(k in line for k in SHUTDOWN_EVENTS)]
        shown += [line for line in self.stdout[-12:] if line not in shown]
        tail = [f"    out| {line}" for line in shown]
        tail += [f"    err| {line}" for line in self.stderr[-8:]]
        tail += [f"    py-spy| {line}" for line in self.dump]
        return "\n".join([head, *tail])


def plan(rounds: int) -> list[Round]:
    """The store's conditions in turn. Across their cycles the SIGTERMs alternate between
    together and staggered; the sync interval is mostly 5 ms (a store round trip is then
    almost always under way when the member stops its fleet: where an exit was once held,
    see the module docstring), else 100 or 1000 ms; in the second cycle a paused or gone
    store is first noticed by every member."""
    out = []
    for i in range(rounds):
        cycle = i // len(CONDITIONS)
        out.append(
            Round(
                number=i,
                condition=CONDITIONS[i % len(CONDITIONS)],
                mode="staggered" if cycle % 2 else "together",
                sync_ms=SYNC_MS[cycle % len(SYNC_MS)],
                notice=cycle == 1,
            )
        )
    return out


async def metric(http: aiohttp.ClientSession, proc: ServeProc, name: str) -> float | None:
    async with asyncio.timeout(REQUEST_S):
        async with http.get(proc.admin_url + "/metrics") as r:
            text = await r.text()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    return None


async def until_store_up(http: aiohttp.ClientSession, proc: ServeProc, up: float) -> None:
    async def check() -> bool:
        return await metric(http, proc, "sidecar_fleet_store_up") == up

    await until(check, f"sidecar_fleet_store_up {up} on {proc.admin_url}", WAIT_S)


async def until_subscribed(redis: RedisProc, n: int) -> None:
    """Every member's listener is subscribed to the store's channel."""
    client = redis.client()
    try:

        async def check() -> bool:
            counts = await client.pubsub_numsub(CHANNEL)
            return bool(counts) and int(counts[0][1]) >= n

        await until(check, f"{n} subscribers on {CHANNEL}", WAIT_S)
    finally:
        await client.aclose()


async def call(http: aiohttp.ClientSession, proc: ServeProc, fault: dict[str, Any]) -> int:
    """One chat request through ``proc`` (the fake answers as ``fault`` says): its status."""
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    async with asyncio.timeout(REQUEST_S):
        async with http.post(
            proc.proxy_url + "/v1/chat/completions",
            json=body,
            headers={FAULT_HEADER: json.dumps(fault)},
        ) as r:
            await r.read()
            return r.status


async def held(http: aiohttp.ClientSession, proc: ServeProc, fault: dict[str, Any]) -> None:
    """A request still in flight at SIGTERM: it ends with the member, however it ends."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with asyncio.timeout(EXIT_LIMIT_S + WAIT_S):
            body = {"model": "gpt-4o", "messages": [], "stream": fault is not STALLED_JSON}
            async with http.post(
                proc.proxy_url + "/v1/chat/completions",
                json=body,
                headers={FAULT_HEADER: json.dumps(fault)},
            ) as r:
                await r.read()


async def steady(http: aiohttp.ClientSession, proc: ServeProc, stop: asyncio.Event) -> None:
    """One request after another until ``stop`` (set at the member's SIGTERM): one is in
    flight at the signal. Each must succeed before it; the one at it may end either way."""
    while not stop.is_set():
        try:
            await call(http, proc, QUICK)
        except (aiohttp.ClientError, TimeoutError):
            if not stop.is_set():
                raise


async def sigterm_and_time(r: Round, proc: ServeProc, name: str, stop: asyncio.Event) -> Exit:
    """SIGTERM ``proc`` and time its exit. One still running 1 s past the bound has its
    Python stacks dumped (py-spy, when installed) into the report, and is killed after
    :data:`EXIT_LIMIT_S`."""
    signalled = datetime.now(UTC).isoformat(timespec="milliseconds")
    started = time.monotonic()
    proc.signal()
    stop.set()
    dump: list[str] = []
    code = await exit_code(proc, BOUND_S + 1.0)
    if code is None:
        dump = await py_spy_dump(proc.proc.pid)
        code = await exit_code(proc, EXIT_LIMIT_S - (time.monotonic() - started))
    seconds = time.monotonic() - started
    if code is None:
        await proc.kill()  # the output read so far is kept
    else:
        with contextlib.suppress(TimeoutError):
            await proc.wait(WAIT_S)  # all its output read
    return Exit(r, name, signalled, seconds, code, proc.stdout, proc.stderr, dump)


async def exit_code(proc: ServeProc, limit_s: float) -> int | None:
    """The exit code, or None while it still runs after ``limit_s`` seconds."""
    try:
        async with asyncio.timeout(max(0.0, limit_s)):
            return await proc.proc.wait()
    except TimeoutError:
        return None


async def py_spy_dump(pid: int) -> list[str]:
    """``py-spy dump`` of a process that holds its exit (best effort: [] without py-spy)."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if exe is None:
        return []
    spy = await asyncio.create_subprocess_exec(
        exe, "dump", "--pid", str(pid),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(WAIT_S):
            out, _ = await spy.communicate()
    except TimeoutError:
        spy.kill()
        await spy.wait()
        return ["py-spy dump timed out"]
    return out.decode(errors="replace").splitlines()


@dataclass
class Store:
    """The round's redis-server and what the members connect to (the slow proxy or it)."""

    redis: RedisProc
    proxy: SlowProxy | None

    def url(self) -> str:
        return self.proxy.url() if self.proxy is not None else self.redis.url()


@contextlib.asynccontextmanager
async def store_for(r: Round, rng: random.Random) -> AsyncIterator[Store]:
    """A fresh redis-server (behind the slow proxy in the ``slow`` condition); both
    stopped at the end (a paused server is resumed to be killed)."""
    redis = await RedisProc().start()
    proxy: SlowProxy | None = None
    try:
        if r.condition == "slow":
            proxy = await SlowProxy(redis.port, rng).start()
        yield Store(redis, proxy)
    finally:
        await redis.kill()
        if proxy is not None:
            await proxy.close()


async def run_round(r: Round, tmp_path: Path, fake: FakeUpstream, rng: random.Random) -> list[Exit]:
    path = tmp_path / f"sidecar-{r.number}.toml"
    server = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "drain_timeout_ms": DRAIN_MS}
    path.write_text(
        chain_config(
            fake.url, fake.url, threshold=2, cooldown_ms=300, sync_ms=r.sync_ms, server=server
        )
    )
    names = [f"pod-{r.number}-{i}" for i in range(MEMBERS)]
    async with (
        store_for(r, rng) as store,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
    ):
        procs: list[ServeProc] = []
        try:
            envs = [child_env(HOSTNAME=n, SIDECAR_REDIS_URL=store.url()) for n in names]
            procs.extend(await asyncio.gather(*(ServeProc.start(path, e) for e in envs)))
            return await _traffic_and_sigterm(r, procs, names, store, http, fake)
        finally:
            await asyncio.gather(*(p.kill() for p in procs))
            fake.release()  # the stalled answers of this round end


async def _traffic_and_sigterm(
    r: Round,
    procs: Sequence[ServeProc],
    names: Sequence[str],
    store: Store,
    http: aiohttp.ClientSession,
    fake: FakeUpstream,
) -> list[Exit]:
    redis = store.redis
    if store.proxy is None:
        await asyncio.gather(*(until_store_up(http, p, 1) for p in procs))
        await until_subscribed(redis, len(procs))
    else:  # every member has connected to the slow store (its first sync is under way)
        proxy = store.proxy

        async def connected() -> bool:
            return proxy.accepted >= len(procs)

        await until(connected, "every member connected to the slow store", WAIT_S)
    # Answers and failures through every member: breakers open, reports and records are
    # written to the store, probes take its lease.
    mix = [QUICK, FAILING, QUICK, FAILING, FAILING, QUICK, QUICK, FAILING, QUICK]
    await asyncio.gather(*(call(http, p, f) for p in procs for f in mix))
    # Work in flight at the SIGTERM, recorded at the fake before it.
    base = fake.request_count
    holders = [asyncio.create_task(held(http, p, f)) for p in procs for f in IN_FLIGHT]
    stops = [asyncio.Event() for _ in procs]
    loops = [asyncio.create_task(steady(http, p, s)) for p, s in zip(procs, stops, strict=True)]

    def all_in_flight() -> bool:
        faults = [json.loads(q.headers.get(FAULT_HEADER, "{}")) for q in fake.requests[base:]]
        return sum(f in IN_FLIGHT for f in faults) >= len(holders)

    exits: list[Exit] = []
    try:
        async with asyncio.timeout(WAIT_S):
            await fake.wait_until(all_in_flight)
        if r.condition == "paused":
            redis.pause()
        elif r.condition == "gone":
            await redis.kill()
        if r.notice and r.condition in ("paused", "gone"):
            await asyncio.gather(*(until_store_up(http, p, 0) for p in procs))
        members = list(zip(procs, names, stops, strict=True))
        if r.mode == "together":
            exits = list(
                await asyncio.gather(*(sigterm_and_time(r, p, n, s) for p, n, s in members))
            )
        else:
            for p, n, s in members:
                exits.append(await sigterm_and_time(r, p, n, s))
    finally:
        for s in stops:
            s.set()
        await asyncio.gather(*(p.kill() for p in procs))  # none left after a failure
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(*holders, return_exceptions=True)
            await asyncio.gather(*loops, return_exceptions=True)
    for task in loops:
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc
    return exits


def summary(exits: Sequence[Exit]) -> str:
    lines = []
    for condition in CONDITIONS:
        times = sorted(e.seconds for e in exits if e.round.condition == condition)
        if times:
            lines.append(
                f"{condition:7} n={len(times):3} median={times[len(times) // 2]:.3f} s "
                f"max={times[-1]:.3f} s"
            )
    forced = sum(any('"exit_forced"' in line for line in e.stdout) for e in exits)
    steps = [
        line
        for e in exits
        for line in e.stdout
        if '"stop_step_timeout"' in line or '"stop_step_failed"' in line
    ]
    lines.append(f"exit_forced: {forced} of {len(exits)}; stop step lines: {len(steps)}")
    lines += [f"  {line}" for line in steps[:10]]
    return "\n".join(lines)


@pytest.mark.timeout(240)
async def test_sigterm_exits_within_drain_plus_one_second_whatever_the_store_does(
    tmp_path: Path,
) -> None:
    rng = random.Random(215)
    exits: list[Exit] = []
    async with FakeUpstream() as fake:
        for r in plan(ROUNDS):
            exits += await run_round(r, tmp_path, fake, rng)
    print(summary(exits))
    assert len(exits) >= 50
    late = [e for e in exits if e.late()]
    assert not late, (
        f"{len(late)} of {len(exits)} SIGTERMs broke the bound\n"
        + "\n".join(e.report() for e in late[:10])
        + "\n"
        + summary(exits)
    )
    idle = [f"{e.round.number}/{e.member}" for e in exits if e.inflight_at_drain() < 2]
    assert not idle, f"drained without the stalled requests in flight: {idle}"

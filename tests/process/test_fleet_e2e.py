"""The fleet across processes: several real ``sidecar serve`` sharing one Redis and one primary.

Each sidecar is a child process (tests/serve_proc.py) with its own ``HOSTNAME``;
the primary and the backup are fake upstreams in the test process; Redis is a
private ``redis-server`` on a free loopback port. Time is real here (short
cooldowns and sync intervals), so every wait is on a condition (``/status``,
``/metrics``, a log line, the fake's request count) with a bounded deadline.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from sidecar.testing import FakeUpstream, Fault
from tests.fleet_helpers import chain_config, needs_redis, redis_server, until
from tests.redis_proc import RedisProc
from tests.serve_proc import ServeProc, child_env

pytestmark = [needs_redis, pytest.mark.timeout(60)]
__all__ = ["redis_server"]

LISTEN = '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
REQUEST_S = 3.0
"""No request may take longer: the store never holds one up (the lease waits <= 250 ms)."""


class Fleet:
    """Start sidecars as members of one fleet; all are killed at the end."""

    def __init__(self, tmp_path: Path, http: aiohttp.ClientSession) -> None:
        self.tmp_path = tmp_path
        self.http = http
        self.procs: list[ServeProc] = []

    async def start(self, text: str, url: str, n: int, **env: str) -> list[ServeProc]:
        path = self.tmp_path / f"sidecar-{len(self.procs)}.toml"
        path.write_text(text.replace("[server]\n", LISTEN, 1))
        envs = [
            child_env(HOSTNAME=f"pod-{len(self.procs) + i}", SIDECAR_REDIS_URL=url, **env)
            for i in range(n)
        ]
        started = await asyncio.gather(*(ServeProc.start(path, e) for e in envs))
        self.procs.extend(started)
        return list(started)

    async def call(self, proc: ServeProc, **body: Any) -> tuple[int, str]:
        """POST a chat request: (status, the upstream that answered)."""
        async with asyncio.timeout(REQUEST_S):
            doc = {"model": "m", "messages": [], **body}
            async with self.http.post(proc.proxy_url + "/v1/chat/completions", json=doc) as r:
                await r.read()
                return r.status, r.headers.get("x-sidecar-upstream", "")

    async def entry(self, proc: ServeProc) -> dict[str, Any] | None:
        async with self.http.get(proc.admin_url + "/status?all=1") as r:
            body = await r.json()
        for e in body["breakers"]:
            if (e["upstream"], e["model"]) == ("primary", "*"):
                return dict(e)
        return None

    async def metric(self, proc: ServeProc, name: str, **labels: str) -> float | None:
        async with self.http.get(proc.admin_url + "/metrics") as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return None

    async def until_entry(self, proc: ServeProc, **want: Any) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            e = await self.entry(proc)
            return e if e is not None and want.items() <= e.items() else None

        return await until(check, f"{want} on {proc.admin_url}")

    async def until_store_up(self, proc: ServeProc, up: float) -> None:
        async def check() -> bool:
            return await self.metric(proc, "sidecar_fleet_store_up") == up

        await until(check, f"sidecar_fleet_store_up {up}")


@pytest_asyncio.fixture
async def fleet(tmp_path: Path, http: aiohttp.ClientSession) -> AsyncIterator[Fleet]:
    f = Fleet(tmp_path, http)
    try:
        yield f
    finally:
        await asyncio.gather(*(p.kill() for p in f.procs))


def events(proc: ServeProc, name: str) -> list[dict[str, Any]]:
    return [e for e in proc.events() if e.get("event") == name]


def alone(procs: list[ServeProc]) -> list[str]:
    """Why a member may have probed by itself: each ``fleet_store_unavailable`` it logged.

    Time is real here: on a loaded machine a lease answer later than its 250 ms bound
    (or a sync round past its own) leaves the member to decide alone, by the contract,
    and a second probe is no bug then. Named in the assertion's message, so that such a
    failure says so.
    """
    return [
        f"{e.get('member')}: {e.get('error')}"
        for p in procs
        for e in events(p, "fleet_store_unavailable")
    ]


async def rounds_until(f: Fleet, procs: list[ServeProc], done: Any, per: int = 3) -> list[Any]:
    """Concurrent traffic (``per`` requests to each sidecar a round) until ``done()``."""
    results: list[Any] = []

    async def one_round() -> bool:
        batch = [f.call(p) for p in procs for _ in range(per)]
        results.extend(await asyncio.gather(*batch))
        return bool(done())

    await until(one_round, "the traffic's condition")
    return results


async def test_an_open_is_shared_one_probe_per_cooldown_and_its_success_closes_everywhere(
    fleet: Fleet, redis_server: RedisProc, fake: FakeUpstream, fake2: FakeUpstream
) -> None:
    text = chain_config(
        fake.url, fake2.url, threshold=2, cooldown_ms=1500, sync_ms=100,
        primary_keys={"first_byte_timeout_ms": 5000},
    )  # fmt: skip
    a, b, c = procs = await fleet.start(text, redis_server.url(), 3)
    fake.set_default(Fault(status=503))
    assert [await fleet.call(a) for _ in range(2)] == [(200, "backup")] * 2
    assert fake.request_count == 2  # A's own breaker opened: one member's failures
    opened = {}
    for p in (b, c):
        opened[p] = await fleet.until_entry(p, state="open", fleet=True)
    for p in (b, c):
        assert [await fleet.call(p) for _ in range(5)] == [(200, "backup")] * 5
    assert fake.request_count == 2  # B and C skip the primary without a single failure

    # The cooldown ends under concurrent traffic: one probe for the fleet (held, fails).
    gate = asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=gate))
    probe = asyncio.ensure_future(rounds_until(fleet, procs, lambda: fake.request_count >= 3))
    async with asyncio.timeout(10):
        await fake.wait_for_requests(3)
    burst = await asyncio.gather(*(fleet.call(p) for p in procs for _ in range(4)))
    assert burst == [(200, "backup")] * 12
    assert fake.request_count == 3, alone(procs)  # exactly one probe while it is in flight
    gate.set()
    assert all(r == (200, "backup") for r in await probe)
    for p in (b, c):  # the failed probe reopened the record for another cooldown
        await until(partial(_newer, fleet, p, opened[p]["retry_at"]), "the record reopened")
    assert fake.request_count == 3

    # The next cooldown: the probe succeeds, and every member closes.
    gate2 = asyncio.Event()
    fake.set_default(Fault(hold_headers=gate2))
    probe = asyncio.ensure_future(rounds_until(fleet, procs, lambda: fake.request_count >= 4))
    async with asyncio.timeout(10):
        await fake.wait_for_requests(4)
    burst = await asyncio.gather(*(fleet.call(p) for p in procs for _ in range(4)))
    assert burst == [(200, "backup")] * 12
    assert fake.request_count == 4, alone(procs)
    gate2.set()
    assert sorted(await probe).count((200, "primary")) == 1
    for p in procs:
        await until(partial(_closed, fleet, p), "closed on every member")
        assert await fleet.call(p) == (200, "primary")
    assert fake.request_count == 4 + len(procs)


async def _newer(f: Fleet, p: ServeProc, retry_at: str) -> dict[str, Any] | None:
    e = await f.entry(p)
    return e if e is not None and e["state"] == "open" and e["retry_at"] > retry_at else None


async def _closed(f: Fleet, p: ServeProc) -> bool:
    e = await f.entry(p)
    return e is not None and e["state"] == "closed"


async def test_open_quorum_two_needs_two_sidecars(
    fleet: Fleet, redis_server: RedisProc, fake: FakeUpstream, fake2: FakeUpstream
) -> None:
    text = chain_config(fake.url, fake2.url, cooldown_ms=30_000, sync_ms=100, quorum=2)
    a, b, c = await fleet.start(text, redis_server.url(), 3)
    fake.set_default(Fault(status=503))
    await fleet.call(a)
    await fleet.until_entry(a, state="open", fleet=False)
    seen = await fleet.metric(c, "sidecar_fleet_syncs_total", result="ok") or 0.0

    async def c_synced_since() -> bool:
        now = await fleet.metric(c, "sidecar_fleet_syncs_total", result="ok") or 0.0
        return now >= seen + 3

    await until(c_synced_since, "C reading the store three more times")
    assert (await fleet.entry(c) or {}).get("state") == "closed"  # one member: no quorum
    assert await fleet.call(b) == (200, "backup")  # B's own breaker opens: the second member
    assert fake.request_count == 2
    await fleet.until_entry(c, state="open", fleet=True)
    assert await fleet.call(c) == (200, "backup")
    assert fake.request_count == 2


@pytest.mark.parametrize("outage", ["killed", "paused", "wrong_password"])
async def test_a_failing_store_fails_no_request_and_the_fleet_converges_when_it_returns(
    outage: str,
    fleet: Fleet,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
) -> None:
    text = chain_config(fake.url, fake2.url, cooldown_ms=60_000, sync_ms=100)
    secret = "store-canary-5e1f0c"
    url = redis_server.url()
    if outage == "wrong_password":  # refused from the start
        await redis_server.kill()
        redis_server.password = secret
        await redis_server.restart()
        url = redis_server.url(password=secret + "-wrong")
    a, b = await fleet.start(text, url, 2)
    if outage != "wrong_password":
        for p in (a, b):
            await fleet.until_store_up(p, 1)
    if outage == "killed":
        await redis_server.kill()
    elif outage == "paused":
        redis_server.pause()
    for p in (a, b):
        await fleet.until_store_up(p, 0)
        await p.wait_for_event("fleet_store_unavailable")

    # Alone, each member serves and its own breaker works; no request waits on the store.
    assert await fleet.call(b) == (200, "primary")
    fake.set_default(Fault(status=503))
    assert [await fleet.call(a) for _ in range(3)] == [(200, "backup")] * 3
    assert fake.request_count == 2
    await fleet.until_entry(a, state="open", fleet=False)
    assert (await fleet.entry(b) or {}).get("state") == "closed"

    async def failed_syncs() -> bool:
        n = await fleet.metric(a, "sidecar_fleet_syncs_total", result="error")
        return (n or 0) >= 3

    await until(failed_syncs, "several failed syncs")

    if outage == "killed":
        await redis_server.restart()
    elif outage == "paused":
        redis_server.resume()
    else:
        client = redis_server.client()
        await client.config_set("requirepass", secret + "-wrong")
        await client.aclose()
    for p in (a, b):
        await fleet.until_store_up(p, 1)
    # A publishes its open breaker again: B follows without a failure of its own.
    await fleet.until_entry(b, state="open", fleet=True)
    assert await fleet.call(b) == (200, "backup")
    assert fake.request_count == 2
    for p in (a, b):
        assert len(events(p, "fleet_store_unavailable")) == 1
        assert len(events(p, "fleet_store_available")) == (1 if outage == "wrong_password" else 2)
        for line in p.stdout + p.stderr:
            assert secret not in line
        async with fleet.http.get(p.admin_url + "/metrics") as r:
            assert secret not in await r.text()
        async with fleet.http.get(p.admin_url + "/status?all=1") as r:
            assert secret not in await r.text()


KEY = "sk-fleet-canary-0a4c2e"
CLIENT = "client-fleet-canary-77b1"
BODY = "body-fleet-canary-9d3e"
PASSWORD = "redis-pw-canary-41f6"


async def test_nothing_but_config_names_members_states_and_times_reach_the_store(
    fleet: Fleet, fake: FakeUpstream, fake2: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    redis = await RedisProc(password=PASSWORD).start()
    try:
        await _scan_scenario(fleet, redis, fake, fake2, http)
    finally:
        await redis.kill()


async def _scan_scenario(
    fleet: Fleet, redis: RedisProc, fake: FakeUpstream, fake2: FakeUpstream, http: Any
) -> None:
    text = chain_config(
        fake.url, fake2.url, cooldown_ms=800, sync_ms=100, server={"log_level": "debug"},
        primary_keys={"api_key_env": "FLEET_TEST_KEY"},
    )  # fmt: skip
    a, b = await fleet.start(text, redis.url(), 2, FLEET_TEST_KEY=KEY)
    listener = redis.client()
    ps = listener.pubsub()
    await ps.subscribe("sidecar:changes")
    messages: list[str] = []

    async def listen() -> None:
        async for m in ps.listen():
            messages.append(json.dumps(m))

    task = asyncio.create_task(listen())
    headers = {"authorization": f"Bearer {CLIENT}", "x-api-key": CLIENT}
    body = {"model": "m", "messages": [{"role": "user", "content": BODY}]}
    seen: dict[str, Any] = {}
    try:
        fake.set_default(Fault(status=503))
        async with http.post(a.proxy_url + "/v1/chat/completions", json=body, headers=headers):
            pass
        await fleet.until_entry(b, state="open", fleet=True)
        seen.update(await redis.dump())
        gate = asyncio.Event()
        fake.set_default(Fault(hold_headers=gate))
        held = asyncio.ensure_future(rounds_until(fleet, [a, b], lambda: fake.request_count >= 2))
        async with asyncio.timeout(10):
            await fake.wait_for_requests(2)
        seen.update(await redis.dump())  # the lease is held now
        gate.set()
        await held
        await until(partial(_closed, fleet, b), "closed")
        seen.update(await redis.dump())  # the close
    finally:
        task.cancel()
        await ps.aclose()  # type: ignore[no-untyped-call]
        await listener.aclose()
    kinds = {key.split(":")[1] for key in seen}
    assert {"record", "reports", "failures", "lease", "close"} <= kinds
    assert all(key.startswith("sidecar:") and key.endswith(":primary:*") for key in seen)
    stored = json.dumps(seen) + "".join(messages)
    for canary in (KEY, CLIENT, BODY, PASSWORD, "127.0.0.1", "://", "Bearer"):
        assert canary not in stored
    assert "pod-0/" in stored and "http_503" in stored
    logged = "\n".join(a.stdout + a.stderr + b.stdout + b.stderr)
    assert '"level":"debug"' in logged
    for canary in (KEY, CLIENT, BODY, PASSWORD):
        assert canary not in logged


async def test_without_a_fleet_table_nothing_of_it_runs(
    fleet: Fleet, fake: FakeUpstream, fake2: FakeUpstream
) -> None:
    text = chain_config(fake.url, fake2.url, fleet=False)
    (p,) = await fleet.start(text, "redis://127.0.0.1:1/0", 1)
    assert await fleet.call(p) == (200, "primary")
    async with fleet.http.get(p.admin_url + "/metrics") as r:
        assert "sidecar_fleet" not in await r.text()
    e = await fleet.entry(p)
    assert e is not None and "fleet" not in e
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys, sidecar.server, sidecar.proxy, sidecar.cli; "
        "sys.exit('redis' in sys.modules or 'sidecar.fleet.runtime' in sys.modules)",
    )
    assert await proc.wait() == 0


def _cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "fleet.toml"
    path.write_text(chain_config("http://127.0.0.1:1", "http://127.0.0.1:2"))
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args, str(path)],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )


def test_check_config_warns_and_serve_refuses_without_the_redis_url_variable(
    tmp_path: Path,
) -> None:
    r = _cli(tmp_path, "check-config")
    assert r.returncode == 0
    assert "warning: fleet.redis_url_env: variable SIDECAR_REDIS_URL is not set" in r.stderr
    assert "[fleet]" in r.stdout and 'redis_url_env = "SIDECAR_REDIS_URL"' in r.stdout
    r = _cli(tmp_path, "serve", "--config")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "error: fleet.redis_url_env: variable SIDECAR_REDIS_URL is not set"
    ]
    r = _cli(tmp_path, "serve", "--config", SIDECAR_REDIS_URL=f"http://:{PASSWORD}@x:1")
    assert r.returncode == 2
    assert "fleet.redis_url_env" in r.stderr and PASSWORD not in r.stderr + r.stdout

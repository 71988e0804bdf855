"""The fleet end to end in one process: several sidecars, one private Redis, the fake clock.

Each sidecar is a separate member (``HOSTNAME`` differs); all share one
:class:`FakeClock`, so cooldowns and the ``sync_interval_ms`` timer move only when
the test advances it. Waits are on the members' own sync counters or on
``/status``, each bounded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from sidecar.breakers.machine import Target
from sidecar.fleet import FleetState
from sidecar.fleet.breakers import FleetBreakers
from sidecar.reload import reload_runtime
from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests import fleet_helpers
from tests.breaker_e2e_helpers import call, entry, first_n_done
from tests.conftest import StartSidecar, status
from tests.fleet_helpers import chain_config, needs_redis, redis_server, roomy_lease_wait, synced
from tests.redis_proc import RedisProc

pytestmark = needs_redis
__all__ = ["redis_server", "roomy_lease_wait"]

SYNC_S = 1.0
COOLDOWN_S = 10.0


async def members(
    start_sidecar: StartSidecar,
    redis: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    n: int,
    quorum: int = 1,
) -> list[Sidecar]:
    cooldown_ms, sync_ms = int(COOLDOWN_S * 1000), int(SYNC_S * 1000)
    text = chain_config(
        fake.url, fake2.url, cooldown_ms=cooldown_ms, sync_ms=sync_ms, quorum=quorum
    )
    return await fleet_helpers.start_members(start_sidecar, text, redis, n)


async def next_sync(sc: Sidecar, clock: FakeClock) -> None:
    """One sync interval on, a round of ``sc`` that read the store after this call."""
    await fleet_helpers.next_sync(sc, clock, SYNC_S)


async def closed_after_next_sync(
    http: aiohttp.ClientSession, sc: Sidecar, clock: FakeClock
) -> None:
    """One sync interval on: ``sc`` has read the fleet's close, so ``primary/*`` is closed."""
    await next_sync(sc, clock)
    assert "primary/*" not in await status(http, sc, all_=False)


async def test_an_open_on_one_member_makes_the_others_skip_within_one_sync_interval(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    a, b, c = await members(start_sidecar, redis_server, fake, fake2, 3)
    fake.set_default(Fault(status=503))
    r = await call(http, a)
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
    assert fake.request_count == 1
    await next_sync(a, clock)  # A's report and the record are written by now
    for sc in (b, c):
        await next_sync(sc, clock)
        r = await call(http, sc)
        assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
        e = await entry(http, sc)
        assert (e["state"], e["fleet"], e["last_failure"]) == ("open", True, "http_503")
        assert e["consecutive_failures"] == 0  # this member's own count: it never failed
    assert fake.request_count == 1  # B and C never called the failing primary
    own = await entry(http, a)
    assert (own["state"], own["fleet"]) == ("open", False)  # A's own breaker


@pytest.mark.usefixtures("roomy_lease_wait")
async def test_one_probe_for_the_whole_fleet_and_its_success_closes_every_member(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    scs = await members(start_sidecar, redis_server, fake, fake2, 3)
    fake.set_default(Fault(status=503))
    await call(http, scs[0])
    for sc in scs:
        await next_sync(sc, clock)
    gate = asyncio.Event()
    fake.set_default(Fault(hold_headers=gate))  # recovered, and the probe is held here
    clock.advance(COOLDOWN_S)  # the record turns half_open
    tasks = [asyncio.create_task(call(http, sc)) for sc in scs for _ in range(4)]
    done, _ = await first_n_done(tasks, len(tasks) - 1)  # all but the held probe
    assert fake.request_count == 2  # the failure, then exactly one probe
    assert all(r.headers["x-sidecar-upstream"] == "backup" for r in done)
    gate.set()
    async with asyncio.timeout(5):
        results = await asyncio.gather(*tasks)
    assert sorted(r.headers["x-sidecar-upstream"] for r in results).count("primary") == 1
    for sc in scs:  # the prober, whichever member won the lease, sends its close
        await next_sync(sc, clock)
    for sc in scs:
        await closed_after_next_sync(http, sc, clock)  # closed on every member
        r = await call(http, sc)
        assert r.headers["x-sidecar-upstream"] == "primary"
    assert fake.request_count == 2 + len(scs)


@pytest.mark.usefixtures("roomy_lease_wait")
async def test_a_failed_fleet_probe_reopens_the_record_for_another_cooldown_without_quorum(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    a, b, c = await members(start_sidecar, redis_server, fake, fake2, 3, quorum=2)
    fake.set_default(Fault(status=503))
    await call(http, a)
    await call(http, b)  # two members opened: quorum
    for sc in (a, b, c):
        await next_sync(sc, clock)
    first = await entry(http, c)
    assert (first["state"], first["fleet"]) == ("open", True)
    clock.advance(COOLDOWN_S)
    r = await call(http, b)  # the fleet's probe, by B: fails
    assert r.headers["x-sidecar-upstream"] == "backup"
    assert fake.request_count == 3
    for sc in (b, a, c):  # B's sync sends the reopened record; then A and C read it
        await next_sync(sc, clock)
    again = await entry(http, c)
    assert (again["state"], again["fleet"]) == ("open", True)
    assert again["retry_at"] > first["retry_at"]  # another cooldown, from one member's failure
    for sc in (a, c):  # A's own breaker is half_open by now, C's closed: both skip
        r = await call(http, sc)
        assert r.headers["x-sidecar-upstream"] == "backup"
    assert fake.request_count == 3


async def test_open_quorum_two_needs_two_members(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    a, b, c = await members(start_sidecar, redis_server, fake, fake2, 3, quorum=2)
    fake.set_default(Fault(status=503))
    await call(http, a)
    for sc in (a, b, c):
        await next_sync(sc, clock)
    assert "primary/*" not in await status(http, c, all_=False)  # one member is not a quorum
    r = await call(http, b)  # B's own breaker opens too: two members
    assert fake.request_count == 2
    for sc in (b, c):
        await next_sync(sc, clock)
    e = await entry(http, c)
    assert (e["state"], e["fleet"]) == ("open", True)
    r = await call(http, c)
    assert r.headers["x-sidecar-upstream"] == "backup"
    assert fake.request_count == 2


@pytest.mark.parametrize("how", ["refused", "wrong_password"])
async def test_a_store_that_fails_from_the_start_changes_nothing_for_requests(
    how: str,
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
) -> None:
    if how == "refused":
        await redis_server.kill()
        url = redis_server.url()
    else:
        await redis_server.kill()
        redis_server.password = "the-password"
        await redis_server.restart()
        url = redis_server.url(password="not-the-password")
    text = chain_config(fake.url, fake2.url, cooldown_ms=10_000, sync_ms=1000)
    sc = await start_sidecar(text, environ={"HOSTNAME": "alone", "SIDECAR_REDIS_URL": url})
    await synced(sc, 1)
    assert sc.fleet is not None and sc.fleet.member.health.up is False
    r = await call(http, sc)
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
    fake.set_default(Fault(status=503))
    await call(http, sc)
    e = await entry(http, sc)
    assert (e["state"], e["fleet"]) == ("open", False)  # the local breaker still works
    r = await call(http, sc)
    assert r.headers["x-sidecar-upstream"] == "backup"
    assert fake.request_count == 2


async def test_a_lease_the_store_cannot_give_in_time_leaves_the_member_to_decide_alone(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = await members(start_sidecar, redis_server, fake, fake2, 2)
    fake.set_default(Fault(status=503))
    await call(http, a)
    await next_sync(a, clock)
    await next_sync(b, clock)
    assert (await entry(http, b))["fleet"] is True
    fake.set_default(Fault())  # recovered
    redis_server.pause()  # B has not noticed: its next sync is a cooldown away
    assert b.fleet is not None and b.fleet.member.state(Target("primary", "*")) is FleetState.OPEN
    clock.t += COOLDOWN_S  # the record turns half_open, with no timer firing (no sync)
    r = await call(http, b)  # B tries the lease: no answer within 250 ms, so B decides alone
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
    assert [rec.getMessage() for rec in caplog.records].count("fleet_store_unavailable") == 1
    r = await call(http, b)  # the store is known down now: no lease tried, no wait
    assert r.headers["x-sidecar-upstream"] == "primary"
    redis_server.resume()


async def test_a_config_reload_keeps_the_fleet_and_its_decisions(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    tmp_path: Path,
) -> None:
    a, b = await members(start_sidecar, redis_server, fake, fake2, 2)
    fake.set_default(Fault(status=503))
    await call(http, a)
    await next_sync(a, clock)
    await next_sync(b, clock)
    path = tmp_path / "sidecar.toml"
    text = chain_config(fake.url, fake2.url, cooldown_ms=int(COOLDOWN_S * 1000), sync_ms=1000)
    path.write_text(text.replace("drain_timeout_ms = 200", "drain_timeout_ms = 300"))
    assert b.runtime is not None and b.fleet is not None
    env = {"HOSTNAME": "pod-1", "SIDECAR_REDIS_URL": redis_server.url()}
    assert await reload_runtime(b.runtime, str(path), env)
    new = b.runtime.current.breakers
    assert isinstance(new, FleetBreakers) and b.fleet.member.local is new.local  # adopted
    e = await entry(http, b)
    assert (e["state"], e["fleet"]) == ("open", True)
    r = await call(http, b)
    assert r.headers["x-sidecar-upstream"] == "backup"
    assert fake.request_count == 1


@pytest.mark.usefixtures("roomy_lease_wait")
async def test_a_probe_slower_than_a_cooldown_keeps_the_other_members_skipping(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    a, b, c = await members(start_sidecar, redis_server, fake, fake2, 3)
    fake.set_default(Fault(status=503))
    await call(http, a)
    for sc in (a, b, c):
        await next_sync(sc, clock)
    gate = asyncio.Event()
    fake.set_default(Fault(hold_headers=gate))
    clock.advance(COOLDOWN_S)
    probe = asyncio.create_task(call(http, b))  # the fleet's probe, held at the primary
    async with asyncio.timeout(5):
        await fake.wait_for_requests(2)
    await next_sync(b, clock)  # B's lease time is in the record now
    clock.advance(COOLDOWN_S)  # past "one cooldown after half_open", the probe still out
    for sc in (a, c):
        await next_sync(sc, clock)
        e = await entry(http, sc)
        assert e["state"] == "half_open"
        r = await call(http, sc)
        assert r.headers["x-sidecar-upstream"] == "backup"
    assert fake.request_count == 2
    gate.set()
    assert (await probe).headers["x-sidecar-upstream"] == "primary"
    await next_sync(b, clock)  # B's close is in the store
    for sc in (a, c):
        await closed_after_next_sync(http, sc, clock)

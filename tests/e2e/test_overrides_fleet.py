"""Operators' overrides with the fleet on: three members, one private ``redis-server``.

Contract, "The admin port": an override taken on one member is "shared with every
member". Each member is a real sidecar in this process (its own ``HOSTNAME``), all on
one :class:`FakeClock`; an override reaches the others through the store (one key per
target, expiring at the override's end) at their next sync. Waits are on the members'
sync counters, each bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest_asyncio

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests import fleet_helpers
from tests.breaker_e2e_helpers import call, entry
from tests.conftest import StartSidecar, metric, status
from tests.e2e.test_overrides import AUTH, TOKEN, TOKEN_VAR, post_override
from tests.fleet_helpers import chain_config, needs_redis, redis_server, synced
from tests.redis_proc import RedisProc

pytestmark = needs_redis
__all__ = ["redis_server"]

SYNC_S = 1.0
COOLDOWN_S = 10.0


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A new connection per request (the fake clock moves past ``client_read_timeout_ms``)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(auto_decompress=False, connector=connector) as s:
        yield s


async def members(
    start_sidecar: StartSidecar, redis: RedisProc, fake: FakeUpstream, fake2: FakeUpstream
) -> list[Sidecar]:
    """Three members; only the first two have the admin token (the third follows the
    fleet without an endpoint of its own)."""
    text = chain_config(
        fake.url,
        fake2.url,
        cooldown_ms=int(COOLDOWN_S * 1000),
        sync_ms=int(SYNC_S * 1000),
        server={"admin_token_env": TOKEN_VAR},
    )
    token = {TOKEN_VAR: TOKEN}
    return await fleet_helpers.start_members(
        start_sidecar, text, redis, 3, env=lambda i: token if i < 2 else {}
    )


async def next_sync(sc: Sidecar, clock: FakeClock) -> None:
    await fleet_helpers.next_sync(sc, clock, SYNC_S)


async def served_by(http: aiohttp.ClientSession, sc: Sidecar) -> str:
    r = await call(http, sc)
    assert r.status == 200
    return r.headers["x-sidecar-upstream"]


async def test_an_override_on_one_member_reaches_every_member_and_auto_ends_it_everywhere(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    a, b, c = await members(start_sidecar, redis_server, fake, fake2)
    body = {"action": "force_open", "reason": "provider maintenance"}
    status_, answer = await post_override(http, a, body)
    assert (status_, answer["override"]["by"]) == (200, f"pod-0/{_pid()}")
    assert await served_by(http, a) == "backup"  # at once on the member that took it
    for sc in (b, c):
        await next_sync(sc, clock)
        assert await served_by(http, sc) == "backup"
        e = await entry(http, sc)
        assert (e["state"], e["fleet"], e["override"]["action"]) == ("open", False, "force_open")
        assert (e["override"]["reason"], e["override"]["by"]) == (
            "provider maintenance",
            f"pod-0/{_pid()}",
        )
        gauge = "sidecar_breaker_override_active"
        target = {"upstream": "primary", "model": "*"}
        assert await metric(http, sc, gauge, **target, action="force_open") == 1
    clock.advance(3 * COOLDOWN_S)  # no member probes a target forced open
    for sc in (a, b, c):
        assert await served_by(http, sc) == "backup"
    assert fake.request_count == 0

    # auto from another member (B) ends it on all three, counts reset.
    status_, answer = await post_override(http, b, {"action": "auto", "reason": "done"})
    assert (status_, answer["state"]) == (200, "closed")
    for sc in (a, c):
        await next_sync(sc, clock)
        e = await entry(http, sc)
        assert (e["state"], "override" in e) == ("closed", False)
        assert await served_by(http, sc) == "primary"
    assert await served_by(http, b) == "primary"


async def test_force_closed_on_one_member_overrules_the_fleets_open_record_everywhere(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    a, b, c = await members(start_sidecar, redis_server, fake, fake2)
    fake.set_default(Fault(status=503))
    assert await served_by(http, c) == "backup"  # C's own breaker opens: the fleet opens
    for sc in (c, a, b):
        await next_sync(sc, clock)
    assert (await entry(http, a))["fleet"] is True
    assert await served_by(http, a) == "backup"
    assert fake.request_count == 1
    fake.set_default(Fault())  # the provider is fine; the breaker misjudged it
    body = {"action": "force_closed", "reason": "the provider is fine"}
    assert (await post_override(http, a, body))[0] == 200
    for sc in (a, b, c):
        await next_sync(sc, clock)
    for sc in (a, b, c):
        assert await served_by(http, sc) == "primary"
        e = await entry(http, sc)
        assert (e["state"], e["fleet"], e["override"]["action"]) == (
            "closed",
            False,
            "force_closed",
        )
    assert "primary/*" in await status(http, c, all_=False)  # listed while overridden


async def test_for_ms_ends_the_override_on_every_member(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    a, b, c = await members(start_sidecar, redis_server, fake, fake2)
    body = {"action": "force_open", "reason": "maintenance", "for_ms": 60_000}
    assert (await post_override(http, b, body))[0] == 200
    for sc in (a, c):
        await next_sync(sc, clock)
        assert (await entry(http, sc))["override"]["for_ms"] == 60_000
    until = {(await entry(http, sc))["override"]["until"] for sc in (a, b, c)}
    assert len(until) == 1  # the same end on every member
    clock.advance(60.0)
    for sc in (a, b, c):
        await next_sync(sc, clock)  # the key has expired in the store too: nothing comes back
        e = await entry(http, sc)
        assert (e["state"], "override" in e) == ("closed", False)
        assert await served_by(http, sc) == "primary"


async def test_a_member_started_later_follows_an_override_in_force(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    a, _, _ = await members(start_sidecar, redis_server, fake, fake2)
    assert (await post_override(http, a, {"action": "force_open", "reason": "m"}))[0] == 200
    await next_sync(a, clock)  # written
    text = chain_config(fake.url, fake2.url, sync_ms=int(SYNC_S * 1000))
    d = await start_sidecar(
        text, environ={"HOSTNAME": "pod-9", "SIDECAR_REDIS_URL": redis_server.url()}
    )
    await synced(d, 1)
    assert (await entry(http, d))["override"]["action"] == "force_open"
    assert await served_by(http, d) == "backup"
    # Without a token of its own, D has no endpoint.
    assert (await post_override(http, d, {"action": "auto"}, headers=AUTH))[0] == 404


def _pid() -> int:
    import os

    return os.getpid()


async def test_an_override_taken_while_the_store_is_down_is_shared_once_it_is_back(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    a, b, _ = await members(start_sidecar, redis_server, fake, fake2)
    await redis_server.kill()
    await next_sync(a, clock)
    assert a.fleet is not None and a.fleet.member.health.up is False
    body = {"action": "force_open", "reason": "maintenance"}
    assert (await post_override(http, a, body))[0] == 200  # no store: applied here all the same
    assert await served_by(http, a) == "backup"
    await next_sync(a, clock)  # a failed round keeps the write queued
    await redis_server.restart()  # back, empty
    await next_sync(a, clock)  # the queued write goes out
    await next_sync(b, clock)
    e = await entry(http, b)
    assert (e["override"]["action"], e["override"]["by"]) == ("force_open", f"pod-0/{_pid()}")
    assert await served_by(http, b) == "backup"

    # The store loses its data: an override without an end is ended on every member
    # (the store is the fleet's memory of it); the documented cost of a store without
    # persistence.
    await redis_server.kill()
    await redis_server.restart()
    for sc in (a, b):
        await next_sync(sc, clock)  # a round that may fail on the stale connection ...
        await next_sync(sc, clock)  # ... then one that reads the empty store
        e = await entry(http, sc)
        assert (e["state"], "override" in e) == ("closed", False)
        assert await served_by(http, sc) == "primary"

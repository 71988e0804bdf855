"""``rate_limit_scope`` with ``[fleet]``: the fleet shares target breakers only.

Two members share one private Redis and the fake clock. Key A's 429s open A's
(target, credential) breaker on the member that saw them, and nowhere else: no fleet
record is written, the other member still sends A's requests, and key B is served by
the target on both members.
"""

from __future__ import annotations

import aiohttp

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream
from tests import fleet_helpers
from tests.breaker_e2e_helpers import call
from tests.conftest import StartSidecar
from tests.fleet_helpers import chain_config, needs_redis, redis_server
from tests.redis_proc import RedisProc

pytestmark = needs_redis
__all__ = ["redis_server"]

SYNC_S = 1.0
KEY_A, KEY_B = "sk-fleet-AAAA-1a2b3c", "sk-fleet-BBBB-4d5e6f"


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def listed(http: aiohttp.ClientSession, sc: Sidecar) -> list[dict[str, object]]:
    async with http.get(sc.admin_url + "/status?all=1") as r:
        doc = await r.json()
    entries: list[dict[str, object]] = doc["breakers"]
    return entries


async def test_a_keys_rate_limit_stays_on_its_member_and_out_of_the_fleet(
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    text = chain_config(fake.url, fake2.url, threshold=1, sync_ms=int(SYNC_S * 1000))
    a, b = await fleet_helpers.start_members(start_sidecar, text, redis_server, 2)
    fake.fault_for_key(KEY_A)
    r = await call(http, a, headers=auth(KEY_A))  # the 429 falls back; A's breaker opens on a
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
    r = await call(http, a, headers=auth(KEY_A))  # skipped on a: straight to the backup
    assert (r.status, r.headers["x-sidecar-upstream"], fake.request_count) == (200, "backup", 1)
    for sc in (a, b):
        await fleet_helpers.next_sync(sc, clock, SYNC_S)
    for sc in (a, b):  # B: the primary on both members (no fleet record)
        r = await call(http, sc, headers=auth(KEY_B))
        assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
    r = await call(http, b, headers=auth(KEY_A))  # b never saw A's 429: it tries the primary
    assert (r.status, r.headers["x-sidecar-upstream"], fake.request_count) == (200, "backup", 4)
    on_a = [e for e in await listed(http, a) if "credential" in e]
    assert [(e["state"], e["fleet"]) for e in on_a] == [("open", False)]  # never the fleet's
    target_a = [e for e in await listed(http, a) if "credential" not in e]
    assert [(e["state"], e["fleet"]) for e in target_a] == [("closed", False)]
    on_b = await listed(http, b)  # b's own A breaker opened on its own 429 now
    assert [(e["state"], "credential" in e) for e in on_b] == [("closed", False), ("open", True)]
    assert KEY_A[8:] not in str(on_a + on_b)

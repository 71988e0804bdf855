"""Routes with tiers, through the running sidecar (interface.md, "Choosing among
candidates"): equal members share by weight, a slow member gets less, a failure moves
to another member of the tier then to the next tier, an open or full member is not
picked.

Speeds are on the injected clock: a fake upstream's ``on_request`` moves the
:class:`FakeClock` by its "time to first token" before it answers, so the sidecar times
that member's first output at exactly that. The chooser's random source is seeded
(``start_sidecar`` gives ``Random(0)``), so every count here is reproducible.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.breaker_e2e_helpers import (
    SERVER_TABLE,
    breaker_table,
    call,
    chain_upstream,
    served_by,
)
from tests.configs import config, route
from tests.conftest import StartSidecar, metric, status

pytestmark = pytest.mark.timeout(60)


@pytest_asyncio.fixture
async def fake3() -> AsyncIterator[FakeUpstream]:
    """A third fake upstream (the next tier)."""
    async with FakeUpstream() as f:
        yield f


def member(name: str, tier: int, weight: float = 1.0) -> dict[str, Any]:
    return {"upstream": name, "tier": tier, "weight": weight}


async def start_tiers(
    start_sidecar: StartSidecar,
    fakes: dict[str, FakeUpstream],
    members: list[dict[str, Any]],
    *,
    balance: str = "least_loaded",
    breaker: dict[str, Any] | None = None,
    **upstream_keys: Any,
) -> Sidecar:
    return await start_sidecar(
        config(
            server=SERVER_TABLE,
            upstreams={
                name: chain_upstream(f.url, breaker=breaker, **upstream_keys)
                for name, f in fakes.items()
            },
            routes=[route("pool", *members, path_prefix="/v1/", balance=balance)],
        )
    )


def takes(clock: FakeClock, seconds: float) -> Any:
    """An ``on_request`` hook: the upstream's time to first token, on the fake clock."""
    return lambda _rec: clock.advance(seconds)


async def test_equal_members_share_by_weight(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_tiers(
        start_sidecar, {"a": fake, "b": fake2}, [member("a", 0, 2), member("b", 0, 1)]
    )
    got = await served_by(http, sc, 300)
    # Expected shares: 2 % each plus the rest by weight, a = 0.66, b = 0.34.
    assert 0.58 < got["a"] / 300 < 0.74, got
    assert fake.request_count + fake2.request_count == 300  # no call went twice


async def test_a_member_three_times_slower_drops_to_under_a_quarter(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    fake.on_request = takes(clock, 0.5)
    fake2.on_request = takes(clock, 1.5)
    sc = await start_tiers(start_sidecar, {"a": fake, "b": fake2}, [member("a", 0), member("b", 0)])
    start = clock.now()
    await served_by(http, sc, 20)  # both sampled; the fake clock is past 10 s now
    assert clock.now() - start < 30
    later = await served_by(http, sc, 200)
    assert later["b"] / 200 <= 0.25, later
    assert later["b"] >= 1, "never starved: the 2 % floor keeps the slow member seen"


async def test_a_failure_moves_to_another_member_then_to_the_next_tier(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    fake3: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_tiers(
        start_sidecar,
        {"a": fake, "b": fake2, "c": fake3},
        [member("a", 0), member("b", 0), member("c", 1)],
    )
    fake.set_default(Fault(status=503))
    for _ in range(20):  # whichever member is picked first, the answer is b's
        r = await call(http, sc)
        assert r.status == 200 and r.headers["x-sidecar-upstream"] == "b"
    assert fake3.request_count == 0, "the next tier is not tried while a member is left"
    fake2.set_default(Fault(status=503))
    before = await metric(http, sc, "sidecar_fallbacks_total", route="pool", upstream="b",
                          reason="failure")  # fmt: skip
    r = await call(http, sc)
    assert r.status == 200 and r.headers["x-sidecar-upstream"] == "c"
    assert r.headers["x-sidecar-attempts"] == "3"
    assert fake3.request_count == 1
    after = await metric(http, sc, "sidecar_fallbacks_total", route="pool", upstream="b",
                         reason="failure")  # fmt: skip
    assert after - before == 1


async def test_an_open_member_is_skipped_and_the_rest_share(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_tiers(
        start_sidecar,
        {"a": fake, "b": fake2},
        [member("a", 0), member("b", 0)],
        breaker=breaker_table(threshold=1, cooldown_ms=60_000),
    )
    fake.script([Fault(status=503)] * 5)
    while (await status(http, sc))["a/*"]["state"] != "open":
        await call(http, sc)
    calls_to_a = fake.request_count
    got = await served_by(http, sc, 50)
    assert got == Counter({"b": 50}) and fake.request_count == calls_to_a


async def test_a_member_with_every_connection_busy_is_not_picked(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_tiers(
        start_sidecar,
        {"a": fake, "b": fake2},
        [member("a", 0), member("b", 0)],
        max_connections=1,
    )
    gate = asyncio.Event()
    # Hold one call on whichever member gets it, on that member's only connection.
    fake.script([Fault(hold_first_chunk=gate)])
    fake2.script([Fault(hold_first_chunk=gate)])
    arrived = asyncio.Event()
    fake.on_request = fake2.on_request = lambda _rec: arrived.set()
    held = asyncio.create_task(call(http, sc))
    async with asyncio.timeout(5):
        await arrived.wait()
    busy, free = (fake, fake2) if fake.request_count == 1 else (fake2, fake)
    fake.script([])
    fake2.script([])
    free_name = "a" if free is fake else "b"
    got = await served_by(http, sc, 30)
    assert got == Counter({free_name: 30}), "the busy member was picked while the other had room"
    assert busy.request_count == 1
    gate.set()
    assert (await held).status == 200

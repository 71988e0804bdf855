"""Sessions that keep their member, through the running sidecar and the official openai
SDK (interface.md, "Choosing among candidates", "Sessions"): a conversation stays on
one member of the tier; an open breaker moves it once, and recovery does not move it
back; a failure that does not open the breaker never moves it.

The SDK sends the session's header on every call (``default_headers``); which member
answered is read from ``x-sidecar-upstream``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.breaker_e2e_helpers import SERVER_TABLE, breaker_table, chain_upstream
from tests.configs import config, route
from tests.conftest import StartSidecar, metric, status

pytestmark = pytest.mark.timeout(60)


@pytest_asyncio.fixture
async def clients() -> AsyncIterator[dict[str, openai.AsyncOpenAI]]:
    """One SDK client per session, closed after the test."""
    made: dict[str, openai.AsyncOpenAI] = {}
    yield made
    for c in made.values():
        await c.close()


async def start(
    start_sidecar: StartSidecar, fake: FakeUpstream, fake2: FakeUpstream, threshold: int = 1
) -> Sidecar:
    members: list[dict[str, Any]] = [
        {"upstream": "a", "tier": 0},
        {"upstream": "b", "tier": 0},
    ]
    cb = breaker_table(threshold=threshold, cooldown_ms=10_000)
    return await start_sidecar(
        config(
            server=SERVER_TABLE,
            upstreams={
                "a": chain_upstream(fake.url, breaker=cb),
                "b": chain_upstream(fake2.url, breaker=cb),
            },
            routes=[route("pool", *members, path_prefix="/v1/", affinity_header="x-session-id")],
        )
    )


async def ask(made: dict[str, openai.AsyncOpenAI], sc: Sidecar, session: str) -> str:
    """One chat call of ``session`` (its own client); the member that answered."""
    c = made.get(session)
    if c is None:
        c = made[session] = openai.AsyncOpenAI(
            base_url=sc.proxy_url + "/v1",
            api_key="k",
            max_retries=0,
            default_headers={"x-session-id": session},
        )
    raw = await c.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    return raw.headers["x-sidecar-upstream"]


async def test_each_conversation_keeps_to_one_member(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clients: dict[str, openai.AsyncOpenAI],
) -> None:
    sc = await start(start_sidecar, fake, fake2)
    placed = {f"s{i}": await ask(clients, sc, f"s{i}") for i in range(20)}
    assert set(placed.values()) == {"a", "b"}, "sessions are placed by balance: both members"
    for _ in range(3):
        for session, member in placed.items():
            assert await ask(clients, sc, session) == member
    assert await metric(http, sc, "sidecar_affinity_total", route="pool", result="new") >= 20
    kept = await metric(http, sc, "sidecar_affinity_total", route="pool", result="kept")
    assert kept >= 60


async def test_an_open_breaker_moves_a_session_once_and_recovery_does_not_move_it_back(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    clients: dict[str, openai.AsyncOpenAI],
) -> None:
    sc = await start(start_sidecar, fake, fake2)
    sessions = [f"t{i}" for i in range(12)]
    placed = {s: await ask(clients, sc, s) for s in sessions}
    on_a = [s for s, m in placed.items() if m == "a"]
    assert on_a, "some session was placed on a"
    moved_before = await metric(http, sc, "sidecar_affinity_total", route="pool", result="moved")
    fake.script([Fault(status=503)])  # a fails once: its breaker (threshold 1) opens
    assert await ask(clients, sc, on_a[0]) == "b"
    assert (await status(http, sc))["a/*"]["state"] == "open"
    for s in on_a:
        assert await ask(clients, sc, s) == "b"
    moved = await metric(http, sc, "sidecar_affinity_total", route="pool", result="moved")
    assert moved - moved_before == len(on_a)
    clock.advance(10.0)  # a recovers: a probe closes it
    fresh = [await ask(clients, sc, f"new{i}") for i in range(12)]
    assert "a" in fresh, "a takes new sessions again"
    assert (await status(http, sc, all_=True))["a/*"]["state"] == "closed"
    for s in on_a:  # ... but the moved sessions stay on b
        assert await ask(clients, sc, s) == "b"


async def test_a_failure_that_leaves_the_breaker_closed_never_moves_a_session(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clients: dict[str, openai.AsyncOpenAI],
) -> None:
    sc = await start(start_sidecar, fake, fake2, threshold=5)
    placed = {f"u{i}": await ask(clients, sc, f"u{i}") for i in range(12)}
    session = next(s for s, m in placed.items() if m == "a")
    fake.script([Fault(status=503)])
    assert await ask(clients, sc, session) == "b"  # this request falls back...
    assert (await status(http, sc, all_=True))["a/*"]["state"] == "closed"
    got = Counter([await ask(clients, sc, session) for _ in range(5)])
    assert got == Counter({"a": 5})  # ... the session does not move

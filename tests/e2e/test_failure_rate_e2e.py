"""Failure-rate breakers end to end (interface.md, "Choosing among candidates",
"Failure rate"): a provider failing 30 % of calls, never twice in a row, is caught
through the running sidecar, seen in ``/status`` and by the upstream's request count.

Each call's answer is scripted on the primary fake before it is sent; time moves
only by ``clock.advance``.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.breaker_e2e_helpers import breaker_table, call, start_chain
from tests.conftest import StartSidecar, metric, status

pytestmark = pytest.mark.timeout(30)

PATTERN = "FSSFSSFSSS"
"""Ten calls: three failures (30 %), never two in a row (a consecutive rule of 2 never opens)."""


async def _start(
    start_sidecar: StartSidecar, primary: FakeUpstream, backup: FakeUpstream, **rate: Any
) -> Sidecar:
    cb = breaker_table(threshold=2, cooldown_ms=30_000, **rate)
    return await start_chain(start_sidecar, primary.url, cb, backup.url)


async def _play(
    http: aiohttp.ClientSession, sc: Sidecar, primary: FakeUpstream, pattern: str
) -> list[str]:
    """One call per letter (F: the primary answers 503, S: 200); the upstream that answered."""
    served = []
    for letter in pattern:
        if letter == "F":
            primary.script([Fault(status=503)])
        r = await call(http, sc)
        assert r.status == 200, "a failure falls back to the backup, which succeeds"
        served.append(r.headers["x-sidecar-upstream"])
    return served


async def test_a_provider_failing_thirty_percent_of_calls_is_caught(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await _start(
        start_sidecar, fake, fake2, failure_rate_threshold=0.3, window_ms=60_000, minimum_calls=10
    )
    served = await _play(http, sc, fake, PATTERN)
    assert served == ["backup" if c == "F" else "primary" for c in PATTERN]
    assert (await status(http, sc))["primary/*"]["state"] == "closed"
    labels = {"upstream": "primary", "model": "*"}
    opened = await metric(http, sc, "sidecar_breaker_transitions_total", to="open", **labels)
    # The 11th call fails: 4 of 11 failed, over 30 %: open, though never two in a row.
    assert await _play(http, sc, fake, "F") == ["backup"]
    entry = (await status(http, sc))["primary/*"]
    assert entry["state"] == "open" and entry["last_failure"] == "http_503"
    assert await metric(http, sc, "sidecar_breaker_state", state="open", **labels) == 1
    after = await metric(http, sc, "sidecar_breaker_transitions_total", to="open", **labels)
    assert after - opened == 1
    # Open: the next call skips the primary without a request to it.
    before = fake.request_count
    assert await _play(http, sc, fake, "S") == ["backup"]
    assert fake.request_count == before


async def test_the_same_calls_spread_past_the_window_never_open(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await _start(
        start_sidecar, fake, fake2, failure_rate_threshold=0.3, window_ms=10_000, minimum_calls=10
    )
    for letter in PATTERN + "F":  # one call every 2 s: the 10 s window never holds 10 calls
        await _play(http, sc, fake, letter)
        clock.advance(2.0)
    assert (await status(http, sc))["primary/*"]["state"] == "closed"


async def test_without_a_threshold_the_consecutive_rule_alone_decides(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await _start(start_sidecar, fake, fake2)
    await _play(http, sc, fake, PATTERN + "FSFSFSFS")
    assert (await status(http, sc))["primary/*"]["state"] == "closed"
    await _play(http, sc, fake, "FF")
    assert (await status(http, sc))["primary/*"]["state"] == "open"

"""Paced recovery through the running sidecar (interface.md, "Choosing among
candidates", "Paced recovery"): after a probe closes the primary's breaker it gets a
tenth of its calls, then a growing share, the rest going to the backup; ``/status``
shows the ramp; a failure during it reopens the breaker at once.

Time moves only by ``clock.advance`` (under ``client_read_timeout_ms``, 30 s, so the
test's idle keep-alive connection to the sidecar stays open).
"""

from __future__ import annotations

from collections import Counter

import aiohttp
import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.breaker_e2e_helpers import breaker_table, call, served_by, start_chain
from tests.conftest import StartSidecar, metric, status

pytestmark = pytest.mark.timeout(60)
LABELS = {"upstream": "primary", "model": "*"}


async def recovered(
    start_sidecar: StartSidecar,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> Sidecar:
    """Primary (breaker: threshold 1, cooldown 10 s, ramp 100 s) opened, then closed by a
    probe at the current time; backup without a breaker."""
    cb = breaker_table(threshold=1, cooldown_ms=10_000, ramp_ms=100_000)
    sc = await start_chain(start_sidecar, fake.url, cb, fake2.url)
    fake.script([Fault(status=503)])
    assert (await call(http, sc)).headers["x-sidecar-upstream"] == "backup"
    clock.advance(10.0)
    r = await call(http, sc)  # the probe
    assert r.headers["x-sidecar-upstream"] == "primary"
    return sc


async def test_a_recovered_primary_takes_back_its_calls_gradually(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await recovered(start_sidecar, fake, fake2, http, clock)
    entry = (await status(http, sc, all_=False))["primary/*"]
    assert (entry["state"], entry["ramp"]) == ("closed", 0.1)
    skips = await metric(http, sc, "sidecar_ramp_skips_total", **LABELS)
    ramp_fallbacks = await metric(
        http, sc, "sidecar_fallbacks_total", route="chat", upstream="primary", reason="ramp"
    )
    assert await served_by(http, sc, 100) == Counter({"primary": 10, "backup": 90})
    assert await metric(http, sc, "sidecar_ramp_skips_total", **LABELS) - skips == 90
    after = await metric(
        http, sc, "sidecar_fallbacks_total", route="chat", upstream="primary", reason="ramp"
    )
    assert after - ramp_fallbacks == 90
    for _ in range(2):  # 50 s after the close (in steps under the idle client timeout)
        clock.advance(25.0)
    assert (await status(http, sc, all_=False))["primary/*"]["ramp"] == 0.5
    assert await served_by(http, sc, 100) == Counter({"primary": 50, "backup": 50})
    for _ in range(3):  # past the ramp: every call is the primary's again
        clock.advance(20.0)
    assert "primary/*" not in await status(http, sc, all_=False)
    assert await served_by(http, sc, 20) == Counter({"primary": 20})


async def test_a_failure_during_the_ramp_reopens_at_once(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await recovered(start_sidecar, fake, fake2, http, clock)
    fake.set_default(Fault(status=503))
    before = fake.request_count
    await served_by(http, sc, 30)  # the 10th call reaches the primary, fails, reopens it
    assert fake.request_count - before == 1
    assert (await status(http, sc))["primary/*"]["state"] == "open"

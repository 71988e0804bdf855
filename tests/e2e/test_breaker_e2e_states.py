"""Breaker end to end: open, half-open probes, closing and reopening (behaviours 6-9).

Probes are held in flight with the fake upstream's Event gates; time moves only
by ``clock.advance``.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.breaker_e2e_helpers import (
    SERVER_TABLE,
    Resp,
    assert_at,
    breaker_table,
    call,
    chain_upstream,
    entry,
    fail,
    first_n_done,
    start_chain,
    until_fake,
    until_status,
)
from tests.configs import config, route
from tests.conftest import StartSidecar, status

# -- 6. every candidate open: 503 circuit_open with Retry-After ---------------------------


async def _both_open(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> tuple[Sidecar, int, int]:
    sc = await start_sidecar(
        config(
            server=SERVER_TABLE,
            upstreams={
                "primary": chain_upstream(
                    fake.url, breaker=breaker_table(threshold=1, cooldown_ms=10_000)
                ),
                "backup": chain_upstream(
                    fake2.url, breaker=breaker_table(threshold=1, cooldown_ms=5_000)
                ),
            },
            routes=[route("chat", "primary", "backup", path_prefix="/v1/")],
        )
    )
    r = await call(http, sc, fault=fail(503))  # primary fails, backup fails: both open
    assert r.status == 503 and r.headers["x-sidecar-upstream"] == "backup"
    s = await status(http, sc, all_=False)
    assert {k: v["state"] for k, v in s.items()} == {"primary/*": "open", "backup/*": "open"}
    return sc, fake.request_count + fake2.request_count, fake.connections_accepted


async def test_all_open_answers_circuit_open_with_shrinking_retry_after(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc, requests, accepted = await _both_open(fake, fake2, start_sidecar, http)
    accepted2 = fake2.connections_accepted
    expected = [(0.0, "5"), (2.5, "3"), (0.4, "3"), (1.1, "1"), (0.5, "1")]
    for step, retry_after in expected:
        clock.advance(step)
        r = await call(http, sc)
        assert r.status == 503
        assert r.headers["Retry-After"] == retry_after, (step, clock.t)
        assert r.headers["x-sidecar-error"] == "circuit_open"
        assert r.headers["x-sidecar-attempts"] == "0"
        assert r.json() == {
            "error": {
                "message": r.json()["error"]["message"],
                "type": "circuit_open",
                "code": "circuit_open",
            }
        }
    assert fake.request_count + fake2.request_count == requests
    assert (fake.connections_accepted, fake2.connections_accepted) == (accepted, accepted2)
    # 5 s after opening the backup's cooldown ends: it is probed again, the primary is not.
    clock.advance(0.5)
    r = await call(http, sc)
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
    assert fake.request_count + fake2.request_count == requests + 1


async def test_all_open_on_messages_path_uses_anthropic_error_shape(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc, requests, _ = await _both_open(fake, fake2, start_sidecar, http)
    r = await call(http, sc, "/v1/messages", model="claude-sonnet-4-5")
    assert r.status == 503
    assert r.headers["Retry-After"] == "5"
    assert r.headers["x-sidecar-error"] == "circuit_open"
    doc = r.json()
    assert doc["type"] == "error"
    assert doc["error"]["type"] == "overloaded_error"
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    assert fake.request_count + fake2.request_count == requests


# -- 7. half-open admits exactly half_open_max_probes -------------------------------------


async def _open_then_half_open(
    sc: Sidecar, http: aiohttp.ClientSession, clock: FakeClock, cooldown_s: float
) -> None:
    r = await call(http, sc, fault=fail(503))
    assert r.status in (200, 503)
    assert (await entry(http, sc))["state"] == "open"
    clock.advance(cooldown_s - 0.001)
    assert (await entry(http, sc))["state"] == "open"
    clock.advance(0.001)
    # The move happens on the timer: visible with no request made.
    e = await entry(http, sc)
    assert (e["state"], e["probes_in_flight"]) == ("half_open", 0)


def _hold_calls(
    fake: FakeUpstream, http: aiohttp.ClientSession, sc: Sidecar, n: int
) -> tuple[asyncio.Event, list[asyncio.Task[Resp]]]:
    """``n`` calls at once; each that reaches the fake is held before its first chunk."""
    gate = asyncio.Event()
    fake.set_default(Fault(hold_first_chunk=gate))
    return gate, [asyncio.create_task(call(http, sc)) for _ in range(n)]


@pytest.mark.parametrize("probes", [1, 3])
async def test_half_open_admits_exactly_max_probes_rest_fall_back(
    probes: int,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    cb = breaker_table(threshold=1, cooldown_ms=2000, probes=probes)
    sc = await start_chain(start_sidecar, fake.url, cb, fake2.url)
    await _open_then_half_open(sc, http, clock, 2.0)
    base, base2 = fake.request_count, fake2.request_count
    gate, tasks = _hold_calls(fake, http, sc, 50)
    try:
        done, held = await first_n_done(tasks, 50 - probes)
        assert all(r.status == 200 and r.headers["x-sidecar-upstream"] == "backup" for r in done)
        assert all(r.headers["x-sidecar-attempts"] == "1" for r in done)
        assert len(held) == probes
        # The held ones are the probes: each reaches the fake (it may still be connecting).
        await until_fake(fake, lambda: fake.request_count >= base + probes)
        assert fake.request_count == base + probes
        assert fake2.request_count == base2 + 50 - probes
        e = await entry(http, sc)
        assert (e["state"], e["probes_in_flight"]) == ("half_open", probes)
    finally:
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    rest = [t.result() for t in tasks]
    assert sum(r.headers["x-sidecar-upstream"] == "primary" for r in rest) == probes
    assert (await entry(http, sc))["state"] == "closed"


@pytest.mark.parametrize("probes", [1, 3])
async def test_half_open_without_backup_rejects_the_rest_with_circuit_open(
    probes: int,
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    cb = breaker_table(threshold=1, cooldown_ms=2000, probes=probes)
    sc = await start_chain(start_sidecar, fake.url, cb)
    await _open_then_half_open(sc, http, clock, 2.0)
    base, accepted = fake.request_count, fake.connections_accepted
    gate, tasks = _hold_calls(fake, http, sc, 50)
    try:
        done, held = await first_n_done(tasks, 50 - probes)
        assert all(r.status == 503 for r in done)
        assert all(r.headers["x-sidecar-error"] == "circuit_open" for r in done)
        assert all(r.headers["x-sidecar-attempts"] == "0" for r in done)
        assert len(held) == probes
        await until_fake(fake, lambda: fake.request_count >= base + probes)
        assert fake.request_count == base + probes
        assert fake.connections_accepted <= accepted + probes
    finally:
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    rest: list[Resp] = [t.result() for t in held]
    assert [r.status for r in rest] == [200] * probes
    assert (await entry(http, sc))["state"] == "closed"


# -- 8. success_threshold closes; a failed probe reopens for a full cooldown ---------------


async def test_success_threshold_probes_close_and_reset(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_chain(
        start_sidecar, fake.url, breaker_table(threshold=2, cooldown_ms=1000, successes=3)
    )
    await call(http, sc, fault=fail(503))
    await call(http, sc, fault=fail(503))
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("open", 2)
    clock.advance(1.0)
    for _ in range(2):
        r = await call(http, sc)
        assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
        e = await entry(http, sc)
        assert (e["state"], e["probes_in_flight"]) == ("half_open", 0)
    r = await call(http, sc)
    assert r.status == 200
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)
    assert e["opened_at"] is None and e["retry_at"] is None
    # The count restarted: one failure does not reopen it (threshold 2), two do.
    await call(http, sc, fault=fail(503))
    assert (await entry(http, sc))["state"] == "closed"
    await call(http, sc, fault=fail(503))
    assert (await entry(http, sc))["state"] == "open"


async def test_failed_probe_reopens_for_a_full_cooldown_from_the_failure(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    cb = breaker_table(threshold=1, cooldown_ms=10_000, successes=2)
    sc = await start_chain(start_sidecar, fake.url, cb)
    t0 = clock.now()
    await call(http, sc, fault=fail(503))
    e = await entry(http, sc)
    assert_at(e["opened_at"], clock, t0)
    assert_at(e["retry_at"], clock, t0 + 10.0)
    clock.advance(10.0)
    assert (await entry(http, sc))["state"] == "half_open"
    clock.advance(3.0)  # a probe that comes late; one success out of two needed
    assert (await call(http, sc)).status == 200
    t1 = clock.now()
    r = await call(http, sc, fault=fail(500))
    assert r.status == 500
    e = await entry(http, sc)
    assert (e["state"], e["last_failure"]) == ("open", "http_500")
    assert_at(e["opened_at"], clock, t1)
    assert_at(e["retry_at"], clock, t1 + 10.0)
    before = fake.request_count
    clock.advance(9.9)
    r = await call(http, sc)
    assert r.headers["x-sidecar-error"] == "circuit_open"
    assert fake.request_count == before
    clock.advance(0.1)
    assert (await entry(http, sc))["state"] == "half_open"
    # The earlier probe success does not carry over: two fresh ones are needed.
    await call(http, sc)
    assert (await entry(http, sc))["state"] == "half_open"
    await call(http, sc)
    assert (await entry(http, sc))["state"] == "closed"


# -- 9. a probe whose client goes away frees its slot ---------------------------------


@pytest.mark.parametrize("gate_field", ["hold_headers", "hold_first_chunk"])
async def test_probe_client_disconnect_frees_the_slot(
    gate_field: str,
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=1, cooldown_ms=1000))
    await _open_then_half_open(sc, http, clock, 1.0)
    gate = asyncio.Event()
    fault = (
        Fault(hold_headers=gate) if gate_field == "hold_headers" else Fault(hold_first_chunk=gate)
    )
    fake.set_default(fault)
    base = fake.request_count
    try:
        async with aiohttp.ClientSession() as leaving:
            probe = asyncio.create_task(
                leaving.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"})
            )
            async with asyncio.timeout(5):
                await fake.wait_for_requests(base + 1)
            e = await entry(http, sc)
            assert (e["state"], e["probes_in_flight"]) == ("half_open", 1)
            # The only slot is taken: another call is skipped.
            r = await call(http, sc)
            assert r.headers["x-sidecar-error"] == "circuit_open"
            assert fake.request_count == base + 1
            probe.cancel()
            with pytest.raises(asyncio.CancelledError):
                await probe
        # The client's connection is closed: the sidecar drops the upstream call.
        await until_fake(fake, lambda: fake.active_requests == 0)
        e = await until_status(http, sc, "primary/*", lambda e: e["probes_in_flight"] == 0)
        assert (e["state"], e["consecutive_failures"]) == ("half_open", 1)
    finally:
        gate.set()
    fake.set_default(Fault())
    r = await call(http, sc)
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
    assert fake.request_count == base + 2
    assert (await entry(http, sc))["state"] == "closed"

"""Breaker end to end: stale results, neutral outcomes, Retry-After (behaviours 10-12).

A slow call is held at the fake upstream by a per-model script with an Event gate
(``script_for_model("slow", ...)``) while other calls move the breaker on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.breaker_e2e_helpers import (
    Resp,
    assert_at,
    breaker_table,
    call,
    entry,
    fail,
    start_chain,
    start_slow,
    until_fake,
    until_status,
)
from tests.conftest import StartSidecar


async def _held(fake: FakeUpstream, task: asyncio.Task[Resp], n: int) -> None:
    """Wait until the fake has received ``n`` requests (the slow one among them)."""
    await until_fake(fake, lambda: fake.request_count >= n)
    assert not task.done()


# -- 10. stale results ------------------------------------------------------------------


@pytest.mark.parametrize("finish_in", ["open", "half_open"])
async def test_slow_success_admitted_before_opening_does_not_close(
    finish_in: str,
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=2, cooldown_ms=1000))
    gate, slow = await start_slow(http, sc, fake, "hold_first_chunk")
    try:
        await _held(fake, slow, 1)
        await call(http, sc, fault=fail(503))
        await call(http, sc, fault=fail(503))
        assert (await entry(http, sc))["state"] == "open"
        if finish_in == "half_open":
            clock.advance(1.0)
            assert (await entry(http, sc))["state"] == "half_open"
    finally:
        gate.set()
    r = await slow
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"], e["probes_in_flight"]) == (finish_in, 2, 0)
    if finish_in == "open":
        # Its success was not remembered either: the breaker still opens fully on time.
        clock.advance(1.0)
        assert (await entry(http, sc))["state"] == "half_open"


async def test_slow_failure_admitted_before_recovery_does_not_reopen(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=1, cooldown_ms=1000))
    gate, slow = await start_slow(http, sc, fake, status=503)
    try:
        await _held(fake, slow, 1)
        await call(http, sc, fault=fail(502))
        assert (await entry(http, sc))["state"] == "open"
        clock.advance(1.0)
        assert (await call(http, sc)).status == 200  # the probe: recovered
        e = await entry(http, sc)
        assert (e["state"], e["consecutive_failures"]) == ("closed", 0)
    finally:
        gate.set()
    r = await slow
    assert r.status == 503  # relayed as it came (the last candidate)
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)
    assert e["last_failure"] != "http_503"


async def test_slow_failure_during_half_open_does_not_reopen_or_take_a_slot(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=2, cooldown_ms=1000))
    gate, slow = await start_slow(http, sc, fake, status=503)
    try:
        await _held(fake, slow, 1)
        await call(http, sc, fault=fail(503))
        await call(http, sc, fault=fail(503))
        clock.advance(1.0)
        assert (await entry(http, sc))["state"] == "half_open"
    finally:
        gate.set()
    assert (await slow).status == 503
    e = await entry(http, sc)
    assert (e["state"], e["probes_in_flight"]) == ("half_open", 0)
    assert (await call(http, sc)).headers["x-sidecar-upstream"] == "primary"
    assert (await entry(http, sc))["state"] == "closed"


async def test_call_between_retries_when_target_opens_moves_on_without_retrying(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_chain(
        start_sidecar, fake.url, breaker_table(threshold=1), fake2.url, retries=2
    )
    gate, slow = await start_slow(http, sc, fake, status=503)
    try:
        await _held(fake, slow, 1)
        await call(http, sc, fault=fail(503))  # three attempts, one failure: open
        assert (await entry(http, sc))["state"] == "open"
    finally:
        gate.set()
    before = fake.request_count
    r = await slow
    # A retry would have reached the primary (healthy now): it is not sent.
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
    assert r.headers["x-sidecar-attempts"] == "2"
    assert fake.request_count == before


# -- 11. neutral outcomes -----------------------------------------------------------------

NEUTRAL_ANSWERS: list[Any] = [
    pytest.param({"status": 200, "empty_body": True}, 200, id="200-empty"),
    pytest.param(fail(400), 400, id="400"),
    pytest.param(fail(401), 401, id="401"),
    pytest.param(fail(403), 403, id="403"),
    pytest.param(fail(404), 404, id="404"),
    pytest.param(fail(422), 422, id="422"),
]


@pytest.mark.parametrize(("fault", "code"), NEUTRAL_ANSWERS)
async def test_neutral_answer_in_closed_neither_counts_nor_resets(
    fault: dict[str, Any],
    code: int,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=3), fake2.url)
    fake.set_default(Fault(status=503))
    await call(http, sc)
    await call(http, sc)
    backup_before = fake2.request_count
    for _ in range(3):
        r = await call(http, sc, fault=fault)
        assert (r.status, r.headers["x-sidecar-upstream"]) == (code, "primary")
        if fault.get("empty_body"):
            assert r.body == b""
    assert fake2.request_count == backup_before  # no fallback either
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 2)
    await call(http, sc)
    assert (await entry(http, sc))["state"] == "open"


@pytest.mark.parametrize(("fault", "code"), NEUTRAL_ANSWERS)
async def test_neutral_probe_frees_its_slot(
    fault: dict[str, Any],
    code: int,
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=1, cooldown_ms=1000))
    await call(http, sc, fault=fail(503))
    clock.advance(1.0)
    before = fake.request_count
    for i in range(1, 4):  # each neutral probe leaves the one slot free for the next
        r = await call(http, sc, fault=fault)
        assert r.status == code
        assert fake.request_count == before + i
        e = await entry(http, sc)
        assert (e["state"], e["probes_in_flight"], e["consecutive_failures"]) == (
            "half_open",
            0,
            1,
        )
    assert (await call(http, sc)).status == 200
    assert (await entry(http, sc))["state"] == "closed"


async def test_status_listed_in_failure_statuses_counts(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    cb = breaker_table(threshold=2, failure_statuses=[404, 503])
    sc = await start_chain(start_sidecar, fake.url, cb, fake2.url)
    fake.set_default(Fault(status=404))
    r = await call(http, sc)
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")  # it falls back
    e = await entry(http, sc)
    assert (e["consecutive_failures"], e["last_failure"]) == (1, "http_404")
    await call(http, sc)
    assert (await entry(http, sc))["state"] == "open"
    # And a status left out of this list (500 here) is neutral for this breaker.
    assert (await call(http, sc)).headers["x-sidecar-upstream"] == "backup"


async def test_client_disconnect_in_closed_neither_counts_nor_resets(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=2))
    await call(http, sc, fault=fail(503))
    gate = asyncio.Event()
    fake.set_default(Fault(hold_first_chunk=gate))
    try:
        async with aiohttp.ClientSession() as leaving:
            task = asyncio.create_task(
                leaving.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"})
            )
            await until_fake(fake, lambda: fake.request_count >= 2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await until_fake(fake, lambda: fake.active_requests == 0)
    finally:
        gate.set()
    e = await until_status(http, sc, "primary/*", lambda e: True)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 1)
    fake.set_default(Fault(status=503))
    await call(http, sc)
    assert (await entry(http, sc))["state"] == "open"


async def test_midstream_reset_is_not_a_failure(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """Contract: the outcome is recorded at the commit point (a 200 stream's first
    output event is a success); the reset after it is neither a failure nor a fallback.
    (A JSON answer is read whole before its commit point, so its cut is a failure:
    test_relay_failures.py.)"""
    sc = await start_chain(
        start_sidecar, fake.url, breaker_table(threshold=2, cooldown_ms=1000), fake2.url
    )
    # A stream: the role chunk (held), the first content event (the commit), then the cut.
    cut = {"reset_after_chunks": 2}
    streamed = {"model": "m", "messages": [], "stream": True}
    await call(http, sc, fault=fail(503))
    for _ in range(3):
        with pytest.raises(aiohttp.ClientPayloadError):
            await call(http, sc, fault=cut, body=streamed)
        e = await entry(http, sc)
        assert e["state"] == "closed"
        assert e["consecutive_failures"] == 0  # the committed 200 reset it; the cut added none
    assert fake2.request_count == 1  # only the first call fell back
    # As a probe: committed, so it closes the breaker, and the cut does not reopen it.
    await call(http, sc, fault=fail(503))
    await call(http, sc, fault=fail(503))
    clock.advance(1.0)
    with pytest.raises(aiohttp.ClientPayloadError):
        await call(http, sc, fault=cut, body=streamed)
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"], e["probes_in_flight"]) == ("closed", 0, 0)


# -- 12. Retry-After on failing answers ---------------------------------------------------


async def test_retry_after_longer_than_cooldown_delays_half_open(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=1, cooldown_ms=1000))
    t0 = clock.now()
    r = await call(http, sc, fault=fail(503, retry_after="7"))
    assert r.status == 503
    e = await entry(http, sc)
    assert e["state"] == "open"
    assert_at(e["retry_at"], clock, t0 + 7.0)
    r = await call(http, sc)
    assert r.headers["Retry-After"] == "7"
    clock.advance(1.0)  # the cooldown is over, the Retry-After is not
    assert (await entry(http, sc))["state"] == "open"
    clock.advance(5.9)
    assert (await entry(http, sc))["state"] == "open"
    clock.advance(0.1)
    assert (await entry(http, sc))["state"] == "half_open"


async def test_retry_after_is_capped_at_retry_after_max(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    cb = breaker_table(threshold=1, cooldown_ms=1000)
    # The target's breaker and a 429: rate limits count against the target (no
    # api_key_env would make them the caller's key's, rate_limit_scope = "credential").
    sc = await start_chain(
        start_sidecar,
        fake.url,
        cb,
        retry_keys={"retry_after_max_ms": 4000},
        primary_keys={"rate_limit_scope": "target"},
    )
    t0 = clock.now()
    await call(http, sc, fault=fail(429, retry_after="3600"))
    e = await entry(http, sc)
    assert (e["state"], e["last_failure"]) == ("open", "http_429")
    assert_at(e["retry_at"], clock, t0 + 4.0)
    clock.advance(4.0)
    assert (await entry(http, sc))["state"] == "half_open"


async def test_retry_after_while_closed_changes_nothing(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=2, cooldown_ms=1000))
    await call(http, sc, fault=fail(503, retry_after="30"))
    e = await entry(http, sc)
    assert (e["state"], e["retry_at"]) == ("closed", None)
    t1 = clock.now()
    await call(http, sc, fault=fail(503))
    e = await entry(http, sc)
    assert e["state"] == "open"
    assert_at(e["retry_at"], clock, t1 + 1.0)
    clock.advance(1.0)
    assert (await entry(http, sc))["state"] == "half_open"


async def test_later_retry_after_extends_and_shorter_never_shortens(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=1, cooldown_ms=1000))
    long_gate, slow_long = await start_slow(
        http, sc, fake, model="slow-long", status=503, retry_after="20"
    )
    short_gate, slow_short = await start_slow(
        http, sc, fake, model="slow-short", status=429, retry_after="2"
    )
    try:
        await until_fake(fake, lambda: fake.request_count >= 2)
        t0 = clock.now()
        await call(http, sc, fault=fail(503, retry_after="5"))
        e = await entry(http, sc)
        assert e["state"] == "open"
        assert_at(e["retry_at"], clock, t0 + 5.0)
        clock.advance(1.0)
        t1 = clock.now()
        long_gate.set()
        assert (await slow_long).status == 503
        e = await entry(http, sc)
        assert_at(e["retry_at"], clock, t1 + 20.0)
        assert_at(e["opened_at"], clock, t0)
        clock.advance(2.0)
        short_gate.set()
        assert (await slow_short).status == 429
        e = await entry(http, sc)
        assert e["state"] == "open"
        assert_at(e["retry_at"], clock, t1 + 20.0)
    finally:
        long_gate.set()
        short_gate.set()
        await asyncio.gather(slow_long, slow_short, return_exceptions=True)
    # The first timer (at t0 + 5) must not move it early.
    clock.advance(t1 + 20.0 - clock.now() - 0.01)
    assert (await entry(http, sc))["state"] == "open"
    clock.advance(0.01)
    assert (await entry(http, sc))["state"] == "half_open"


async def test_retry_after_on_a_neutral_answer_does_not_extend(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """Only a failing answer's Retry-After extends an open breaker (a 400 is the caller's)."""
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=1, cooldown_ms=1000))
    gate, slow = await start_slow(http, sc, fake, status=400, retry_after="30")
    try:
        await _held(fake, slow, 1)
        t0 = clock.now()
        await call(http, sc, fault=fail(503))
    finally:
        gate.set()
    assert (await slow).status == 400
    e = await entry(http, sc)
    assert e["state"] == "open"
    assert_at(e["retry_at"], clock, t0 + 1.0)
    clock.advance(1.0)
    assert (await entry(http, sc))["state"] == "half_open"

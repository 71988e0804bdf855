"""The fleet's probe lease and ``request_timeout_ms``, end to end (one process, fake clock).

A request that runs out of ``request_timeout_ms`` while it waits for the fleet's
probe lease gets the sidecar's deadline answer, as any other request deadline
before the commit point (contract, "Error answers"): 504 ``upstream_timeout``, or
502 ``upstream_unavailable`` when an earlier candidate's transport failure was the
last error. Not a closed connection.

The route is ``front`` (no breaker) then ``primary`` (breaker, shared through the
fleet). The request's one timer is armed by ``front``'s attempt; then ``primary``'s
fleet record is half_open, so the request waits for the lease, which never answers
here (the store's ``take_lease`` is replaced by a wait that ends only when
cancelled). The test moves the fake clock past the request deadline once that
wait has started (an Event), so no wall-clock time decides anything.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from sidecar.breakers.machine import Target
from sidecar.fleet import FleetState
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.breaker_e2e_helpers import breaker_table, call, chain_upstream
from tests.configs import config as build_config
from tests.configs import route
from tests.conftest import StartSidecar
from tests.fleet_helpers import (
    WAIT_S,
    needs_redis,
    next_sync,
    redis_server,
    roomy_lease_wait,
    synced,
)
from tests.redis_proc import RedisProc

pytestmark = needs_redis
__all__ = ["redis_server", "roomy_lease_wait"]

COOLDOWN_S = 10.0
REQUEST_TIMEOUT_S = 0.1
PRIMARY = Target("primary", "*")


def config(front_url: str, primary_url: str) -> str:
    cb = breaker_table(threshold=1, cooldown_ms=int(COOLDOWN_S * 1000))
    return build_config(
        server={"drain_timeout_ms": 200, "request_timeout_ms": int(REQUEST_TIMEOUT_S * 1000)},
        upstreams={
            "front": chain_upstream(front_url, breaker=None),
            "primary": chain_upstream(primary_url, breaker=cb),
        },
        routes=[route("chat", "front", "primary", path_prefix="/v1/")],
        fleet={
            "redis_url_env": "SIDECAR_REDIS_URL",
            "key_prefix": "sidecar:",
            "sync_interval_ms": 1000,
            "open_quorum": 1,
        },
    )


@pytest.mark.parametrize(
    ("front_fault", "status", "code"),
    [
        (Fault(status=503), 504, "upstream_timeout"),  # an HTTP answer: a timeout
        (Fault(reset_before_headers=True), 502, "upstream_unavailable"),  # transport failure
    ],
    ids=["after_a_failing_answer", "after_a_transport_failure"],
)
# The lease's own 250 ms bound is loop (wall) time; this test's deadline is on the fake
# clock: the bound is widened so only the fake clock decides (a failure, not a pace).
@pytest.mark.usefixtures("roomy_lease_wait")
async def test_a_request_deadline_while_waiting_for_the_lease_is_the_deadline_answer(
    front_fault: Fault,
    status: int,
    code: str,
    start_sidecar: StartSidecar,
    redis_server: RedisProc,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    front, primary = fake2, fake
    text = config(front.url, primary.url)
    a, b = [
        await start_sidecar(
            text, environ={"HOSTNAME": name, "SIDECAR_REDIS_URL": redis_server.url()}
        )
        for name in ("pod-0", "pod-1")
    ]
    for sc in (a, b):
        await synced(sc, 1)
    front.set_default(front_fault)
    primary.set_default(Fault(status=503))
    await call(http, a)  # front fails, then primary's 503 opens A's breaker
    assert (front.request_count, primary.request_count) == (1, 1)
    assert a.fleet is not None and b.fleet is not None
    await next_sync(a, clock, 1.0)  # A writes the record
    await next_sync(b, clock, 1.0)  # B reads it
    assert b.fleet.member.state(PRIMARY) is FleetState.OPEN
    await next_sync(b, clock, COOLDOWN_S)  # the record turns half_open
    assert b.fleet.member.state(PRIMARY) is FleetState.HALF_OPEN

    waiting = asyncio.Event()

    async def never_answers(t: Target, lease_s: float) -> tuple[bool, object]:
        waiting.set()
        await asyncio.Event().wait()  # ends only by cancellation
        raise AssertionError("unreachable")

    assert b.fleet.member.store is not None
    monkeypatch.setattr(b.fleet.member.store, "take_lease", never_answers)

    task = asyncio.create_task(call(http, b))
    async with asyncio.timeout(WAIT_S):
        await waiting.wait()  # front's attempt is done; the request waits for the lease
    assert front.request_count == 2
    clock.advance(REQUEST_TIMEOUT_S)  # request_timeout_ms runs out during that wait
    async with asyncio.timeout(WAIT_S):
        r = await task
    assert r.status == status
    assert r.headers["x-sidecar-error"] == code
    assert r.json()["error"]["code"] == code
    assert r.headers["x-sidecar-attempts"] == "1"  # front's; primary was never sent
    assert primary.request_count == 1
    assert not b.fleet.member.busy(PRIMARY)  # the lease attempt is over, no probe held
    # With a store that answers again, B's next request takes the lease: the fleet's probe.
    monkeypatch.undo()
    primary.set_default(Fault())
    r = await call(http, b)
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
    assert primary.request_count == 2

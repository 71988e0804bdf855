"""The fleet tests' ``next_sync`` waits for a sync round that began after it was called.

A round already in flight when ``next_sync`` is called may have read the store before
the write the test waits to see (CI once failed that way: a member's ``/status`` still
showed the record from before another member's failed probe). Here the sync loop runs
for real on a :class:`FakeClock`, each round held on an ``asyncio.Event`` gate, so the
order of steps is fixed: no Redis, no wall clock.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from sidecar import metrics
from sidecar.config import FleetConfig
from sidecar.fleet.runtime import Fleet
from sidecar.server import Sidecar
from sidecar.testing import FakeClock
from tests.fleet_helpers import next_sync


async def test_next_sync_lets_a_round_in_flight_end_and_waits_for_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    fleet = Fleet(FleetConfig(sync_interval_ms=1000), "redis://127.0.0.1:1", "pod-0/1", clock)
    gates: list[asyncio.Event] = []
    started = asyncio.Event()

    async def held_round() -> None:
        gate = asyncio.Event()
        gates.append(gate)
        started.set()
        await gate.wait()

    loop = fleet.sync_loop
    monkeypatch.setattr(loop, "round", held_round)
    fleet.member.store = cast(Any, object())  # a running fleet's (the rounds here never use it)
    loop_task = asyncio.create_task(loop.run())
    try:
        fleet.member.wake.set()
        await started.wait()  # round 1 is in flight: it may have read a stale store
        started.clear()
        sc = cast(Sidecar, SimpleNamespace(fleet=fleet))
        waiter = asyncio.create_task(next_sync(sc, clock, 1.0))
        gates[0].set()  # round 1 ends; only then does next_sync move the clock
        round_2 = asyncio.create_task(started.wait())
        async with asyncio.timeout(5):
            await asyncio.wait({waiter, round_2}, return_when=asyncio.FIRST_COMPLETED)
        assert not waiter.done()  # round 1 does not count: it began before the call
        assert len(gates) == 2  # the clock moved after round 1 ended: round 2 began
        gates[1].set()
        async with asyncio.timeout(5):
            await waiter
        assert (loop.syncs_started, loop.syncs) == (2, 2)
    finally:
        loop_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop_task


async def test_a_stop_whose_cancellation_a_round_swallows_still_ends_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """#21 item 5: on Python 3.11 redis-py's ``asyncio.wait_for`` can lose the sync task's
    cancellation (CPython gh-86296); the round then returns normally. ``Fleet.stop``
    awaited the task forever (the loop re-armed its timer and went on), so a fleet
    member never exited. Here a round swallows its cancellation on purpose."""
    clock = FakeClock()
    fleet = Fleet(FleetConfig(sync_interval_ms=1000), "redis://127.0.0.1:1", "pod-0/1", clock)
    in_round = asyncio.Event()

    async def swallowing_round() -> None:
        in_round.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return  # lost, as inside redis-py's wait_for on 3.11

    monkeypatch.setattr(fleet.sync_loop, "round", swallowing_round)

    class NoStore:
        async def aclose(self) -> None:
            return None

    fleet.member.store = cast(Any, NoStore())
    metrics.register_fleet()  # as Fleet.start does (stop unregisters)
    fleet.sync_loop.start()  # the sync loop and the listener (which waits: no store answer)
    loop_task = fleet.sync_loop.tasks[0]
    async with asyncio.timeout(5):
        await in_round.wait()
        await fleet.stop()
        await asyncio.wait({loop_task})  # the loop ends by itself: no timer re-armed
    assert loop_task.done() and not loop_task.cancelled()

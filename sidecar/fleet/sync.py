"""The fleet's background task: the sync loop and the pub/sub listener.

Runs on :class:`~sidecar.fleet.runtime.Fleet`'s state (the same event loop; no
locks: every change happens between awaits). A round sends the writes the request
path queued (reports, probe results, lease releases), reads every target, applies
published closes to this member's own breakers, publishes its missing reports
again and writes the records a quorum calls for. Any failure drops the fleet's
view (each member decides alone), is logged once per outage, and resets the
store's connection pool so none is stale when the store returns.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from sidecar import logs, metrics
from sidecar.breaker import Target
from sidecar.fleet import TargetView, missing_reports, quorum_record, record_ttl_s

if TYPE_CHECKING:
    from sidecar.fleet.breakers import FleetBreakers
    from sidecar.fleet.runtime import Fleet
    from sidecar.fleet.store import Store


async def run(fleet: Fleet) -> None:
    """The sync loop: wait for a wake-up (timer, local change, announcement), sync, re-arm.

    Ends by itself once the fleet stops (``fleet.store`` is None), not only by its
    cancellation: on Python 3.11 a cancellation that lands while redis-py sends a
    command inside ``asyncio.wait_for`` can be lost (CPython gh-86296, fixed in 3.12),
    and the round then returns as if nothing happened.
    """
    while True:
        await fleet._wake.wait()
        fleet._wake.clear()
        if fleet._timer is not None:
            fleet._timer.cancel()
        if fleet.store is None:
            return
        fleet.syncs_started += 1
        await sync(fleet)
        fleet.syncs += 1
        fleet._synced.set()
        if fleet.store is None:  # stopped during the round (its cancellation was lost)
            return
        when = fleet.clock.now() + fleet.cfg.sync_interval_s
        fleet._timer = fleet.clock.call_at(when, fleet._wake.set)


async def listen(fleet: Fleet) -> None:
    """Wake the sync on every change another member announces."""
    while True:
        await fleet._listen_ok.wait()
        store = fleet.store
        assert store is not None
        try:
            async for _ in store.changes():
                if fleet.store is None:  # stopped (see run: a lost cancellation)
                    return
                fleet._wake.set()
        except Exception:  # the sync loop notices an outage; retried after its next success
            fleet._listen_ok.clear()


async def sync(fleet: Fleet) -> None:
    """One round: send queued writes, read every target, settle; or note the failure."""
    store, breakers = fleet.store, fleet.breakers
    if store is None or breakers is None:
        return
    writes, fleet._pending = fleet._pending, []
    sent: dict[Target, int] = {}
    try:
        async with asyncio.timeout(fleet.timeout_s * (2 + len(writes))):
            for seq, t, write in writes:
                await write(store)
                if t is not None:
                    sent[t] = seq
            views = await store.read(fleet.targets)
            await settle(fleet, store, breakers, views)
    except Exception as exc:
        fleet.failed(exc)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(fleet.timeout_s):
                await store.reset()
        return
    for t, seq in sent.items():
        over = fleet._overrides.get(t)
        if over is not None and over[0] <= seq:
            del fleet._overrides[t]
    fleet.views = views
    metrics.FLEET_SYNCS.labels("ok").inc()
    if (event := fleet.health.observe(True)) is not None:
        metrics.FLEET_STORE_UP.set(1)
        logs.event(event, member=fleet.member)
    fleet._listen_ok.set()


async def settle(
    fleet: Fleet, store: Store, breakers: FleetBreakers, views: dict[Target, TargetView]
) -> None:
    """After a read: apply closes, publish missing reports, write quorum records."""
    now = fleet.now()
    breakers.apply_closes(views, fleet._applied)
    for t, report in missing_reports(breakers.own_reports(), views, now):
        await fleet.send_report(store, t, report)
        v = views[t]
        views[t] = TargetView(v.record, v.close, (*v.reports, report))
    for t, v in views.items():
        info = fleet.targets[t]
        rec = quorum_record(
            v.reports, v.record, now, fleet.cfg.open_quorum, info.cooldown_s, fleet.member
        )
        if rec is not None:
            await store.write_record(t, rec, record_ttl_s(rec, now, info.cooldown_s))
            views[t] = TargetView(rec, v.close, v.reports)

"""The fleet's background tasks: the sync loop and the pub/sub listener.

:class:`SyncLoop` owns when the store is talked to: its timer, its tasks and the
count of its rounds. What it reads and writes is :class:`~sidecar.fleet.member.Member`'s,
through that class's public methods (the same event loop; no locks: every change
happens between awaits). A round sends the writes the request path queued (reports,
probe results, lease releases), reads every target, applies published closes to this
member's own breakers, publishes its missing reports again and writes the records a
quorum calls for; operators' overrides taken here are written, and those read are
followed. Any failure drops the fleet's view (each member decides alone), is
logged once per outage, and resets the store's connection pool so none is stale when
the store returns.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from sidecar import metrics
from sidecar.breakers.machine import State, Target
from sidecar.clock import TimerHandle
from sidecar.fleet import Report, TargetView, missing_reports, quorum_record, record_ttl_s
from sidecar.fleet.member import Member

if TYPE_CHECKING:
    from sidecar.fleet.store import Store


class SyncLoop:
    """Syncs ``member`` with its store: at once when woken (``member.wake``: a queued
    write, an announcement by another member), else every ``sync_interval_ms`` (a timer
    on the member's injected clock).

    :param member: the member whose view and outbox it syncs; ``member.store`` must be
        set before :meth:`start`, and the loop ends once it is None again.
    """

    def __init__(self, member: Member) -> None:
        self.member = member
        self.tasks: list[asyncio.Task[None]] = []
        """The running tasks (:meth:`run`, :meth:`listen`), from :meth:`start`."""
        self.syncs = 0
        """Completed sync rounds (either result); tests wait on it with :meth:`wait_syncs`."""
        self.syncs_started = 0
        """Sync rounds begun; ``syncs_started - syncs`` is 1 while a round is in flight (a
        round in flight may have read the store before a write another member just made)."""
        self._timer: TimerHandle | None = None
        self._synced = asyncio.Event()

    def start(self) -> None:
        """Start the sync loop and the listener as tasks of the running loop (returns at
        once; never waits for the store), and wake the first round."""
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self.run()), loop.create_task(self.listen())]
        self.member.wake.set()

    async def stop(self, timeout_s: float) -> None:
        """Cancel the timer and the tasks; wait for them at most ``timeout_s`` seconds.

        Waited for, not awaited: a task whose cancellation redis-py lost (:meth:`run`)
        ends at its next step, and a stop must not wait for that (nor swallow its own
        cancellation, as ``suppress(CancelledError)`` around ``await task`` did).
        """
        if self._timer is not None:
            self._timer.cancel()
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=timeout_s)

    async def wait_syncs(self, n: int) -> None:
        """Return once :attr:`syncs` ``>= n`` (no timeout: the caller bounds it)."""
        while self.syncs < n:
            self._synced.clear()
            await self._synced.wait()

    async def run(self) -> None:
        """The sync loop: wait for a wake-up (timer, local change, announcement), sync, re-arm.

        Ends by itself once the fleet stops (``member.store`` is None), not only by its
        cancellation: on Python 3.11 a cancellation that lands while redis-py sends a
        command inside ``asyncio.wait_for`` can be lost (CPython gh-86296, fixed in 3.12),
        and the round then returns as if nothing happened.
        """
        member = self.member
        while True:
            await member.wake.wait()
            member.wake.clear()
            if self._timer is not None:
                self._timer.cancel()
            if member.store is None:
                return
            self.syncs_started += 1
            await self.round()
            self.syncs += 1
            self._synced.set()
            if member.store is None:  # stopped during the round (its cancellation was lost)
                return
            when = member.clock.now() + member.cfg.sync_interval_s
            self._timer = member.clock.call_at(when, member.wake.set)

    async def listen(self) -> None:
        """Wake the sync on every change another member announces."""
        member = self.member
        while True:
            await member.answering.wait()
            store = member.store
            if store is None:  # stopped
                return
            try:
                async for _ in store.changes():
                    if member.store is None:  # stopped (see run: a lost cancellation)
                        return
                    member.wake.set()
            except Exception:  # the sync loop notices an outage; retried after its next success
                member.answering.clear()

    async def round(self) -> None:
        """One round: send queued writes, read every target, settle; or note the failure."""
        member = self.member
        store = member.store
        if store is None or member.local is None:
            return
        writes = member.take_writes()
        overrides = member.override_writes()
        sent: dict[Target, int] = {}
        try:
            async with asyncio.timeout(member.timeout_s * (2 + len(writes) + len(overrides))):
                for seq, t, write in writes:
                    await write(store)
                    if t is not None:
                        sent[t] = seq
                for t, _, rec in overrides:
                    await member.send_override(store, t, rec)
                views = await store.read(member.targets)
                await self._settle(store, views)
        except Exception as exc:
            metrics.FLEET_SYNCS.labels("error").inc()
            member.failed(exc)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(member.timeout_s):
                    await store.reset()
            return
        metrics.FLEET_SYNCS.labels("ok").inc()
        member.succeeded(views, sent)
        member.overrides_written(overrides)

    async def _settle(self, store: Store, views: dict[Target, TargetView]) -> None:
        """After a read: apply closes, publish missing reports, write quorum records."""
        member = self.member
        now = member.now()
        member.apply_closes(views)
        member.apply_overrides(views)
        for t, report in missing_reports(own_reports(member), views, now):
            await member.send_report(store, t, report)
            v = views[t]
            views[t] = TargetView(v.record, v.close, (*v.reports, report), v.override)
        quorum = member.cfg.open_quorum
        for t, v in views.items():
            info = member.targets[t]
            rec = quorum_record(v.reports, v.record, now, quorum, info.cooldown_s, member.name)
            if rec is not None:
                await store.write_record(t, rec, record_ttl_s(rec, now, info.cooldown_s))
                views[t] = TargetView(rec, v.close, v.reports, v.override)


def own_reports(member: Member) -> dict[Target, Report]:
    """``member``'s own open breakers as reports (``retry_at`` in Unix seconds)."""
    out: dict[Target, Report] = {}
    wall = member.clock.wall
    for t, st in [] if member.local is None else member.local.states():
        if st.state is State.OPEN and st.retry_at is not None:
            out[t] = Report(member.name, wall(st.retry_at), st.last_failure)
    return out

"""This member of the fleet: what it knows of the store, what it has yet to tell it.

:class:`Member` is the state the request path and the background sync share (one per
process, only with ``[fleet]``; it outlives config reloads). It owns:

* the fleet's view: the last sync's read, plus this member's own writes not yet read
  back; dropped while the store does not answer;
* the outbox: writes the request path queues, sent by :mod:`sidecar.fleet.sync`;
* the probe lease (:meth:`Member.take_lease`, the request path's only wait on the
  store: 250 ms at most) and the fleet probes in flight here;
* the newest generation's own breakers (``local``): their opens become reports,
  published closes close them;
* operators' overrides: those taken on this member's admin port are written (one key
  per target, expiring at the override's end), and those read from the store are
  followed (:meth:`Member.apply_overrides`).

Everything runs on the event loop between awaits (no locks). The rules are
:mod:`sidecar.fleet`, the commands :mod:`sidecar.fleet.store`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from sidecar import logs, metrics
from sidecar.breakers.live import LiveBreakers
from sidecar.breakers.machine import Permit, State, Target, Transition, Verdict
from sidecar.breakers.types import AUTO, FORCE_OPEN
from sidecar.clock import Clock
from sidecar.config import FleetConfig
from sidecar.fleet import (
    CLOSE_KEPT_SYNCS,
    LEASE_WAIT_S,
    Close,
    FleetState,
    LeaseOutcome,
    OverrideRecord,
    Record,
    Report,
    StoreHealth,
    TargetView,
    after_lease,
    after_probe,
    close_applies,
    record_state,
    record_ttl_s,
)

if TYPE_CHECKING:
    from sidecar.fleet.store import Store

Write = Callable[["Store"], Awaitable[None]]
"""A queued store write: sent by the sync, with the store it runs on."""


class TargetInfo(NamedTuple):
    """What the fleet needs to know of a target: its cooldown and lease time (seconds)."""

    cooldown_s: float
    lease_s: float


class Member:
    """One member of the fleet (see the module docstring).

    :param cfg: the ``[fleet]`` table.
    :param name: this member's name (``<HOSTNAME>/<pid>``).
    :param clock: the injected clock; store times are Unix seconds, ``clock.wall(...)``.
    """

    def __init__(self, cfg: FleetConfig, name: str, clock: Clock) -> None:
        self.cfg = cfg
        self.name = name
        self.clock = clock
        self.timeout_s = min(1.0, max(LEASE_WAIT_S, cfg.sync_interval_s))
        """Bound on one store step (connect, read), seconds."""
        self.health = StoreHealth()
        self.store: Store | None = None
        """The store while the fleet runs (:meth:`sidecar.fleet.runtime.Fleet.start`)."""
        self.targets: dict[Target, TargetInfo] = {}
        """The newest generation's targets with a breaker."""
        self.local: LiveBreakers | None = None
        """The newest generation's own breakers (:meth:`adopt`)."""
        self.views: dict[Target, TargetView] = {}
        """The targets as the last successful sync read them."""
        self.wake = asyncio.Event()
        """Set when the sync should run now (a queued write, its timer, an announcement)."""
        self.answering = asyncio.Event()
        """Set by a successful sync, cleared by any store failure (the listener waits on it)."""
        self._overrides: dict[Target, tuple[int, TargetView]] = {}
        self._outbox: list[tuple[int, Target | None, Write]] = []
        self._seq = 0
        self._leasing: set[Target] = set()
        self._probes: dict[Target, Permit] = {}
        self._applied: dict[Target, float] = {}
        self._override_writes: dict[Target, tuple[int, OverrideRecord]] = {}
        """Overrides taken on this member's admin port, not yet written (kept across a
        failed sync: sent again by the next one), with their sequence number."""
        self._seen_overrides: dict[Target, tuple[float, str]] = {}
        """Per target, the (``at``, ``by``) of the last override record followed here."""

    def adopt(
        self, targets: dict[Target, TargetInfo], local: LiveBreakers, keep: Collection[Target]
    ) -> None:
        """Serve a new generation (the newest wins): its targets and own breakers. Fleet
        probes in flight stay for the targets in ``keep`` (contract, "Reload": their
        permits settle on the new breakers); the others are forgotten."""
        self.targets = targets
        self.local = local
        self._probes = {t: p for t, p in self._probes.items() if t in keep}

    # -- views, for the request path (no awaits) ------------------------------------

    def now(self) -> float:
        """Unix seconds, from the injected clock."""
        return self.clock.wall(self.clock.now())

    def record(self, t: Target) -> Record | None:
        """The fleet record of ``t`` as known here (None: none, or the store is down)."""
        if self.health.up is not True:
            return None
        over = self._overrides.get(t)
        view = over[1] if over is not None else self.views.get(t)
        return None if view is None else view.record

    def state(self, t: Target) -> FleetState:
        """The fleet record's state for ``t`` now; NONE when the store is not answering,
        or while an operator's override holds ``t`` (the operator decides, not the fleet)."""
        info = self.targets.get(t)
        if info is None:
            return FleetState.NONE
        record = self.record(t)
        if record is None:
            return FleetState.NONE
        local = self.local
        if local is not None and local.override(t) is not None:
            return FleetState.NONE
        return record_state(record, self.now(), info.cooldown_s)

    def busy(self, t: Target) -> bool:
        """This member is taking ``t``'s lease or holds it for a probe in flight."""
        return t in self._leasing or t in self._probes

    # -- the probe lease: the request path's one wait ------------------------------------

    async def take_lease(self, permit: Permit) -> LeaseOutcome:
        """Try to take the probe lease of ``permit``'s target, waiting at most 250 ms;
        LOCAL when the store gives no answer. On PROBE, ``permit`` is the fleet's probe
        until :meth:`settle_probe`."""
        t = permit.target
        store, info = self.store, self.targets.get(t)
        if store is None or info is None or self.health.up is not True:
            return LeaseOutcome.LOCAL
        self._leasing.add(t)
        try:
            async with asyncio.timeout(LEASE_WAIT_S):
                taken, record = await store.take_lease(t, info.lease_s)
        except Exception as exc:  # any store failure: decide alone
            self.failed(exc)
            return LeaseOutcome.LOCAL
        finally:
            self._leasing.discard(t)
        now = self.now()
        outcome, give_back = after_lease(taken, record, now, info.cooldown_s)
        if give_back:
            self._override(t, record=record)
            self._queue(t, lambda s: s.release_lease(t))
        elif outcome is LeaseOutcome.PROBE and record is not None:
            # Half-open for as long as the lease: a slow probe keeps the others skipping.
            probing = msgspec.structs.replace(record, probe_until=now + info.lease_s)
            self._override(t, record=probing)
            ttl = record_ttl_s(probing, now, info.cooldown_s)
            self._queue(t, lambda s: s.write_record(t, probing, ttl))
            self._probes[t] = permit
        return outcome

    def settle_probe(
        self,
        permit: Permit,
        verdict: Verdict | None,
        last_failure: str | None = None,
        retry_after_s: float | None = None,
    ) -> bool:
        """Settle the fleet's probe if ``permit`` is it: a success closes the target
        everywhere (returns True), a failure opens the record again, no verdict gives
        the lease back."""
        t = permit.target
        if self._probes.get(t) is not permit:
            return False
        del self._probes[t]
        info = self.targets.get(t)
        if info is None:
            return False
        write = after_probe(
            verdict,
            self.now(),
            info.cooldown_s,
            self.name,
            retry_after_s=retry_after_s,
            last_failure=last_failure,
        )
        if isinstance(write, Record):
            self._override(t, record=write)
            ttl = record_ttl_s(write, self.now(), info.cooldown_s)
            self._queue(t, lambda s: s.probe_failed(t, write, ttl))
        elif write is not None:
            self._publish_close(t, write)
            return True
        else:
            self._queue(t, lambda s: s.release_lease(t))
        return False

    # -- this member's own breakers ---------------------------------------------------------

    def publish(self, transitions: Iterable[Transition]) -> None:
        """Tell the fleet of this member's own moves: an open publishes a report, a
        probe's success (half_open -> closed) a close."""
        for tr in transitions:
            t = tr.target
            if tr.to_state is State.OPEN and tr.state.retry_at is not None:
                wall = self.clock.wall(tr.state.retry_at)
                self._publish_report(t, Report(self.name, wall, tr.state.last_failure))
            elif tr.from_state is State.HALF_OPEN and tr.to_state is State.CLOSED:
                self._publish_close(t, Close(self.now(), self.name))

    def apply_closes(self, views: Mapping[Target, TargetView]) -> None:
        """Close this member's own breakers that a published close applies to (logged and
        counted as a close; nothing is published back)."""
        local = self.local
        if local is None:
            return
        for t, view in views.items():
            st = local.state(t)
            if st is None or view.close is None:
                continue
            since = None if st.opened_at is None else self.clock.wall(st.opened_at)
            if st.state is State.CLOSED:
                since = None
            if close_applies(view.close, since, self._applied.get(t)):
                self._applied[t] = view.close.at
                local.force_close(t)

    # -- operators' overrides -------------------------------------------------------------

    def publish_override(self, t: Target, record: OverrideRecord) -> None:
        """Share an override taken on this member's admin port (already applied here):
        written by the next sync (at once: it is woken), and again after a failed one."""
        if t not in self.targets:
            return
        self._seen_overrides[t] = (record.at, record.by)
        self._seq += 1
        self._override_writes[t] = (self._seq, record)
        self.wake.set()

    def override_writes(self) -> list[tuple[Target, int, OverrideRecord]]:
        """The overrides to write (they stay queued until :meth:`overrides_written`)."""
        return [(t, seq, rec) for t, (seq, rec) in self._override_writes.items()]

    def overrides_written(self, sent: Iterable[tuple[Target, int, OverrideRecord]]) -> None:
        """A sync wrote (and read back) ``sent``: those not replaced since are done."""
        for t, seq, _ in sent:
            queued = self._override_writes.get(t)
            if queued is not None and queued[0] == seq:
                del self._override_writes[t]

    async def send_override(self, store: Store, t: Target, record: OverrideRecord) -> None:
        """Write ``record`` for ``t``: a ``force_*`` until its end (none when it has none;
        nothing when it has ended already), an ``auto`` for :data:`CLOSE_KEPT_SYNCS` sync
        intervals.

        :raises Exception: the store's errors (redis-py's, :class:`OSError`)."""
        if record.action == AUTO:
            ttl: float | None = CLOSE_KEPT_SYNCS * self.cfg.sync_interval_s
        elif record.until is None:
            ttl = None
        else:
            ttl = record.until - self.now()
            if ttl <= 0:
                return
        reset = record.action != FORCE_OPEN
        await store.write_override(t, record, ttl, reset=reset)

    def apply_overrides(self, views: Mapping[Target, TargetView]) -> None:
        """Follow the overrides another member's admin port took (each record once), and
        end one that is gone from the store while it had no end of its own (deleted by
        hand, or the store lost its data). Targets with a write of this member's still
        queued keep what this member was told last."""
        local = self.local
        if local is None:
            return
        now = self.now()
        for t, view in views.items():
            if t in self._override_writes:
                continue
            rec = view.override
            if rec is None:
                current = local.override(t)
                if current is not None and current.until is None:
                    self._seen_overrides.pop(t, None)
                    local.apply_override(t, None, source="fleet", reason="gone from the store")
                continue
            ident = (rec.at, rec.by)
            if self._seen_overrides.get(t) == ident:
                continue
            self._seen_overrides[t] = ident
            if rec.action == AUTO:
                local.apply_override(t, None, source="fleet", reason=rec.reason)
            elif rec.until is None or rec.until > now:
                ov = local.override_at(
                    rec.action, rec.reason, rec.until, rec.for_ms, rec.at, rec.by
                )
                local.apply_override(t, ov, source="fleet")

    # -- for the sync -------------------------------------------------------------------------

    def take_writes(self) -> list[tuple[int, Target | None, Write]]:
        """Empty the outbox: the queued writes, oldest first, with sequence and target."""
        writes, self._outbox = self._outbox, []
        return writes

    async def send_report(self, store: Store, t: Target, report: Report) -> None:
        """Write ``report`` for ``t``, kept a cooldown past its ``retry_at``.

        :raises Exception: the store's errors (redis-py's, :class:`OSError`)."""
        now = self.now()
        keep = report.retry_at + self.targets[t].cooldown_s - now
        await store.report(t, report, keep, now)

    def succeeded(self, views: dict[Target, TargetView], sent: Mapping[Target, int]) -> None:
        """A sync read ``views`` after sending writes up to number ``sent[t]`` per target:
        they are the view now, and own writes read back stop overriding it."""
        for t, seq in sent.items():
            over = self._overrides.get(t)
            if over is not None and over[0] <= seq:
                del self._overrides[t]
        self.views = views
        if (event := self.health.observe(True)) is not None:
            metrics.FLEET_STORE_UP.set(1)
            logs.event(event, member=self.name)
        self.answering.set()

    def failed(self, exc: BaseException) -> None:
        """The store failed: drop the fleet's view (each member decides alone); logged
        once per outage."""
        self.views = {}
        self._overrides.clear()
        self.answering.clear()
        if (event := self.health.observe(False)) is not None:
            metrics.FLEET_STORE_UP.set(0)
            # The class name only: redis-py's messages may name the host.
            logs.event(event, level=logging.WARNING, member=self.name, error=type(exc).__name__)

    # -- internals ---------------------------------------------------------------------------

    def _queue(self, t: Target | None, write: Write) -> None:
        self._seq += 1
        self._outbox.append((self._seq, t, write))
        self.wake.set()

    def _override(self, t: Target, *, record: Record | None, close: Close | None = None) -> None:
        """Set what this member knows of ``t`` now, ahead of the store (kept until a sync
        that sent this member's latest write for ``t`` has read the store)."""
        view = self.views.get(t, TargetView())
        new = TargetView(record, close or view.close, view.reports, view.override)
        self._overrides[t] = (self._seq + 1, new)

    def _publish_report(self, t: Target, report: Report) -> None:
        if t in self.targets:
            self._queue(t, lambda s: self.send_report(s, t, report))

    def _publish_close(self, t: Target, close: Close) -> None:
        self._applied[t] = close.at
        self._override(t, record=None, close=close)
        keep = CLOSE_KEPT_SYNCS * self.cfg.sync_interval_s
        self._queue(t, lambda s: s.probe_succeeded(t, close, keep))

"""A generation's breakers with the fleet on: the local breakers, plus the fleet's decisions.

:class:`FleetBreakers` is :class:`~sidecar.live_breakers.LiveBreakers`
with the fleet's hooks (used only when the config has ``[fleet]``):

* ``admit``: a call the member's own breaker admits is skipped while the fleet
  record is open, and needs the probe lease while it is half_open
  (:meth:`lease_needed`, then ``await`` :meth:`lease`: the request path's only
  wait on the store, bounded by 250 ms);
* ``record`` / ``release``: the fleet's probe settles (close everywhere, or the
  record open again, and the lease given back);
* transitions: a local open publishes a report, a local probe's success a close;
* ``may_continue``: no retry while the fleet record is open or half_open (as for
  a breaker that opens between retries; the fleet's probe is one request);
* ``retry_in`` and ``status``: the fleet record counts; ``/status`` entries get
  ``fleet``.

``sidecar_breaker_state`` stays this member's own breaker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeGuard

from sidecar import metrics
from sidecar.breaker import (
    BreakerSettings,
    BreakerState,
    Permit,
    State,
    Target,
    Transition,
    Verdict,
)
from sidecar.clock import Clock
from sidecar.config import Config
from sidecar.fleet import (
    LEASE_SLACK_S,
    Admission,
    Close,
    FleetState,
    LeaseOutcome,
    Record,
    Report,
    TargetView,
    admission,
    after_probe,
    close_applies,
)
from sidecar.live_breakers import LiveBreakers, rfc3339

if TYPE_CHECKING:
    from sidecar.fleet.runtime import Fleet


class TargetInfo:
    """What the fleet needs to know of a target: its cooldown and lease time (seconds)."""

    __slots__ = ("cooldown_s", "lease_s")

    def __init__(self, cooldown_s: float, lease_s: float) -> None:
        self.cooldown_s = cooldown_s
        self.lease_s = lease_s


def target_info(
    config: Config, settings: Mapping[Target, BreakerSettings]
) -> dict[Target, TargetInfo]:
    """Per target with a breaker: its cooldown, and ``first_byte_timeout_ms`` + 1 s (lease)."""
    return {
        t: TargetInfo(
            s.cooldown_s, config.upstreams[t.upstream].first_byte_timeout_s + LEASE_SLACK_S
        )
        for t, s in settings.items()
    }


class FleetBreakers(LiveBreakers):
    """Breakers of one generation that share decisions through ``fleet``."""

    def __init__(
        self,
        settings: Mapping[Target, BreakerSettings],
        clock: Clock,
        initial: Mapping[Target, BreakerState] | None = None,
        *,
        fleet: Fleet,
    ) -> None:
        self.fleet = fleet
        # A reload keeps an unchanged breaker's fleet probe in flight (contract,
        # "Reload"): its permit settles here (Runtime.retire), so its lease does too.
        old = fleet.breakers
        self._probes: dict[Target, Permit] = (
            {t: p for t, p in old._probes.items() if t in initial}
            if old is not None and initial
            else {}
        )
        self._fleet_closing = False
        super().__init__(settings, clock, initial)
        fleet.breakers = self

    def probing(self, t: Target) -> bool:
        """A fleet probe of this member is in flight for ``t``."""
        return t in self._probes

    def _reject(self, permit: Permit) -> None:
        super().release(permit)
        metrics.BREAKER_REJECTIONS.labels(permit.target.upstream, permit.target.model).inc()

    # -- admission ---------------------------------------------------------------------

    def admit(self, target: Target) -> Permit | None:
        permit = super().admit(target)
        if permit is None or permit.generation < 0:
            return permit
        fleet = self.fleet
        if admission(fleet.state(target), fleet.busy(target)) is Admission.SKIP:
            self._reject(permit)
            return None
        return permit

    def lease_needed(self, permit: Permit | None) -> TypeGuard[Permit]:
        if permit is None:
            return False
        fleet = self.fleet
        adm = admission(fleet.state(permit.target), fleet.busy(permit.target))
        return permit.generation >= 0 and adm is Admission.LEASE

    async def lease(self, permit: Permit) -> Permit | None:
        try:
            outcome = await self.fleet.take_lease(permit.target)
        except BaseException:  # cancelled (the client left): the local permit is freed
            super().release(permit)
            raise
        if outcome is LeaseOutcome.PROBE:
            self._probes[permit.target] = permit
            return permit
        if outcome is LeaseOutcome.SKIP:
            self._reject(permit)
            return None
        return permit

    def may_continue(self, permit: Permit) -> bool:
        state = self.fleet.state(permit.target)
        return state is FleetState.NONE and super().may_continue(permit)

    # -- results -------------------------------------------------------------------------

    def record(
        self,
        permit: Permit,
        verdict: Verdict,
        *,
        last_failure: str | None = None,
        retry_after_s: float | None = None,
    ) -> Sequence[Transition]:
        closed = self._settle_probe(permit, verdict, last_failure, retry_after_s)
        self._fleet_closing = closed
        try:
            moves = super().record(
                permit, verdict, last_failure=last_failure, retry_after_s=retry_after_s
            )
            if closed:  # the fleet's probe succeeded: closed here too, whatever success_threshold
                self._close_locally(permit.target)
        finally:
            self._fleet_closing = False
        return moves

    def release(self, permit: Permit) -> None:
        self._settle_probe(permit, None, None, None)
        super().release(permit)

    def _settle_probe(
        self,
        permit: Permit,
        verdict: Verdict | None,
        last_failure: str | None,
        retry_after_s: float | None,
    ) -> bool:
        """Settle the fleet's probe (when ``permit`` is it); True when it closed the target."""
        t = permit.target
        if self._probes.get(t) is not permit:
            return False
        del self._probes[t]
        fleet = self.fleet
        info = fleet.targets.get(t)
        if info is None:
            return False
        write = after_probe(
            verdict,
            fleet.now(),
            info.cooldown_s,
            fleet.member,
            retry_after_s=retry_after_s,
            last_failure=last_failure,
        )
        if isinstance(write, Record):
            fleet.publish_reopen(t, write)
        elif write is not None:
            fleet.publish_close(t, write)
            return True
        else:
            fleet.release_lease(t)
        return False

    def _close_locally(self, t: Target) -> None:
        """Close this member's own breaker for ``t`` (the fleet closed it), logged and counted."""
        moved = self.breakers.force_close(t)
        if moved is not None:
            self._fleet_closing = True
            try:
                super()._emit([moved])
            finally:
                self._fleet_closing = False

    def _emit(self, transitions: list[Transition]) -> None:
        super()._emit(transitions)
        if self._closed or self._fleet_closing:
            return
        for tr in transitions:
            t = tr.target
            if tr.to_state is State.OPEN and tr.state.retry_at is not None:
                wall = self.clock.wall(tr.state.retry_at)
                self.fleet.publish_report(t, Report(self.fleet.member, wall, tr.state.last_failure))
            elif tr.from_state is State.HALF_OPEN and tr.to_state is State.CLOSED:
                self.fleet.publish_close(t, Close(self.fleet.now(), self.fleet.member))

    # -- what the fleet asks ---------------------------------------------------------------

    def own_reports(self) -> dict[Target, Report]:
        """This member's open breakers as reports (``retry_at`` in Unix seconds)."""
        out = {}
        for t, st in self.breakers.items():
            if st.state is State.OPEN and st.retry_at is not None:
                wall = self.clock.wall(st.retry_at)
                out[t] = Report(self.fleet.member, wall, st.last_failure)
        return out

    def apply_closes(
        self, views: Mapping[Target, TargetView], applied: dict[Target, float]
    ) -> None:
        """Close this member's own breakers that a published close applies to."""
        for t, view in views.items():
            st = self.breakers.state(t)
            if st is None or view.close is None:
                continue
            since = None if st.opened_at is None else self.clock.wall(st.opened_at)
            if st.state is State.CLOSED:
                since = None
            if close_applies(view.close, since, applied.get(t)):
                applied[t] = view.close.at
                self._close_locally(t)

    # -- views -------------------------------------------------------------------------------

    def retry_in(self, targets: Iterable[Target]) -> float | None:
        waits: list[float] = []
        now = self.fleet.now()
        for t in targets:
            local = super().retry_in([t])
            record = self.fleet.record(t)
            if self.fleet.state(t) is FleetState.OPEN and record is not None:
                fleet_wait = max(0.0, record.retry_at - now)
                local = fleet_wait if local is None else max(local, fleet_wait)
            if local is not None:
                waits.append(local)
        return min(waits, default=None)

    def status(self, all_targets: bool) -> list[dict[str, object]]:
        out = []
        for entry in super().status(True):
            t = Target(str(entry["upstream"]), str(entry["model"]))
            state = self.fleet.state(t)
            record = self.fleet.record(t)
            by_fleet = entry["state"] == State.CLOSED.value and state is not FleetState.NONE
            if by_fleet and record is not None:
                entry["state"] = state.value
                entry["opened_at"] = rfc3339(record.opened_at)
                entry["retry_at"] = rfc3339(record.retry_at)
                entry["last_failure"] = record.last_failure
            entry["fleet"] = by_fleet
            if all_targets or entry["state"] != State.CLOSED.value:
                out.append(entry)
        return out

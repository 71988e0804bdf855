"""A generation's breakers with the fleet on: this member's own breakers, plus the fleet's say.

:class:`FleetBreakers` is a :class:`~sidecar.breakers.port.BreakerPort` that holds a
:class:`~sidecar.breakers.live.LiveBreakers` (``local``: counts, timer, logs and
metrics, as without the fleet) and the process's :class:`~sidecar.fleet.member.Member`
(what the fleet says; built only when the config has ``[fleet]``). Each call asks
the local breakers first, then the fleet:

* ``admit``: a call the member's own breaker admits is skipped while the fleet
  record is open, and needs the probe lease while it is half_open
  (:meth:`~FleetBreakers.lease_needed`, then ``await`` :meth:`~FleetBreakers.lease`:
  the request path's only wait on the store, bounded by 250 ms);
* ``record`` / ``release``: the fleet's probe settles (close everywhere, or the
  record open again, and the lease given back); the local moves are published
  (an open as a report, a local probe's success as a close);
* ``may_continue``: no retry while the fleet record is open or half_open (as for
  a breaker that opens between retries; the fleet's probe is one request);
* ``retry_in`` and ``status``: the fleet record counts; ``/status`` entries get
  ``fleet``;
* ``set_override``: an operator's override is applied here and shared with every
  member; while one holds a target, the fleet's record of it is not followed
  (:meth:`~sidecar.fleet.member.Member.state`).

``sidecar_breaker_state`` stays this member's own breaker. The breakers of (target,
credential) (``rate_limit_scope``) stay this member's own: the fleet never sees them,
and a rate limit that counts against a credential is neutral for the fleet's probe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeGuard

from sidecar import metrics
from sidecar.breakers.live import LiveBreakers, rfc3339
from sidecar.breakers.machine import BreakerState, Permit, State, Target, Transition, Verdict
from sidecar.breakers.types import AUTO
from sidecar.fleet import Admission, FleetState, LeaseOutcome, OverrideRecord, admission
from sidecar.fleet.member import Member


class FleetBreakers:
    """Breakers of one generation that share decisions through the fleet.

    :param local: this generation's own breakers (closed with them by :meth:`close`).
    :param member: the process's fleet member, which has adopted ``local``
        (:meth:`~sidecar.fleet.member.Member.adopt`).
    """

    def __init__(self, local: LiveBreakers, member: Member) -> None:
        self.local = local
        self.member = member
        self.credentials = local.credentials
        """The local breakers of (target, credential): never shared."""

    def _reject(self, permit: Permit) -> None:
        """Skip a call the local breaker admitted: free its slot, count a rejection."""
        self.local.release(permit)
        metrics.BREAKER_REJECTIONS.labels(permit.target.upstream, permit.target.model).inc()

    # -- admission ---------------------------------------------------------------------

    def admit(self, target: Target) -> Permit | None:
        """The local breaker's permit, or None while the fleet says skip."""
        permit = self.local.admit(target)
        if permit is None or permit.generation < 0:
            return permit
        member = self.member
        if admission(member.state(target), member.busy(target)) is Admission.SKIP:
            self._reject(permit)
            return None
        return permit

    def admit_credential(self, permit: Permit, headers: Mapping[str, str]) -> Permit | None:
        """As :meth:`LiveBreakers.admit_credential`; a refused ``permit`` is settled here."""
        checked = self.local.credential_permit(permit, headers)
        if checked is None:
            self.release(permit)
        return checked

    def credential_skip(self, target: Target, headers: Mapping[str, str]) -> tuple[bool, float]:
        """As :meth:`LiveBreakers.credential_skip` (local only)."""
        return self.local.credential_skip(target, headers)

    def lease_needed(self, permit: Permit | None) -> TypeGuard[Permit]:
        """Whether ``permit`` needs the probe lease (the fleet record is half_open)."""
        if permit is None or permit.generation < 0:
            return False
        member = self.member
        return admission(member.state(permit.target), member.busy(permit.target)) is (
            Admission.LEASE
        )

    async def lease(self, permit: Permit) -> Permit | None:
        """Take the probe lease (at most 250 ms): ``permit`` to send the fleet's probe or
        to decide alone, None when another member probes (``permit`` is then settled).

        :raises asyncio.CancelledError: the caller left; the local permit is freed.
        """
        try:
            outcome = await self.member.take_lease(permit)
        except BaseException:  # cancelled (the client left): the local permit is freed
            self.local.release(permit)
            raise
        if outcome is LeaseOutcome.SKIP:
            self._reject(permit)
            return None
        return permit

    def may_continue(self, permit: Permit) -> bool:
        """No retry while the fleet record says open or half_open, nor once the local
        breaker moved."""
        state = self.member.state(permit.target)
        return state is FleetState.NONE and self.local.may_continue(permit)

    # -- results -------------------------------------------------------------------------

    def record(
        self,
        permit: Permit,
        verdict: Verdict,
        *,
        last_failure: str | None = None,
        retry_after_s: float | None = None,
        rate_limit: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> Sequence[Transition]:
        """Settle ``permit`` here and, when it is the fleet's probe, for the fleet; the
        local moves are published (none when the fleet's probe just closed the target:
        it is closed here too then, whatever ``success_threshold``). A rate limit that
        counts against the request's credential is neutral for the fleet's probe."""
        member = self.member
        if rate_limit and self.local.on_credential(permit, verdict, rate_limit):
            closed = member.settle_probe(permit, Verdict.NEUTRAL, None, None)
        else:
            closed = member.settle_probe(permit, verdict, last_failure, retry_after_s)
        moves = self.local.record(
            permit,
            verdict,
            last_failure=last_failure,
            retry_after_s=retry_after_s,
            rate_limit=rate_limit,
            headers=headers,
        )
        if closed:
            self.local.force_close(permit.target)
        elif moves and not self.local.closed:
            member.publish(moves)
        return moves

    def release(self, permit: Permit) -> None:
        """Settle ``permit`` with no verdict, here and as the fleet's probe (lease back)."""
        self.member.settle_probe(permit, None)
        self.local.release(permit)

    def note_retry_after(self, target: Target, retry_after_s: float) -> None:
        """As :meth:`LiveBreakers.note_retry_after` (the fleet keeps its own times)."""
        self.local.note_retry_after(target, retry_after_s)

    # -- views -------------------------------------------------------------------------------

    def last_failure(self, target: Target) -> str | None:
        """The local breaker's ``last_failure`` of ``target``."""
        return self.local.last_failure(target)

    def retry_in(self, targets: Iterable[Target]) -> float | None:
        """Seconds until the soonest of ``targets`` allows a call, the longer of the local
        wait and an open fleet record's; None if every target is unknown."""
        waits: list[float] = []
        member = self.member
        now = member.now()
        local = self.local
        for t in targets:
            wait = local.retry_in([t])
            record = member.record(t)
            if member.state(t) is FleetState.OPEN and record is not None:
                fleet_wait = max(0.0, record.retry_at - now)
                wait = fleet_wait if wait is None else max(wait, fleet_wait)
            if wait is not None:
                waits.append(wait)
        return min(waits, default=None)

    def status(self, all_targets: bool) -> list[dict[str, object]]:
        """``/status`` entries; a target closed here but open or half_open in the fleet
        shows the fleet record, with ``"fleet": true``."""
        out = []
        member = self.member
        for entry in self.local.status(True):
            if "credential" in entry:  # a (target, credential) breaker: local, ?all=1 only
                entry["fleet"] = False
                if all_targets:
                    out.append(entry)
                continue
            t = Target(str(entry["upstream"]), str(entry["model"]))
            state = member.state(t)
            record = member.record(t)
            by_fleet = entry["state"] == State.CLOSED.value and state is not FleetState.NONE
            if by_fleet and record is not None:
                entry["state"] = state.value
                entry["opened_at"] = rfc3339(record.opened_at)
                entry["retry_at"] = rfc3339(record.retry_at)
                entry["last_failure"] = record.last_failure
            entry["fleet"] = by_fleet
            listed = "ramp" in entry or "override" in entry
            if all_targets or entry["state"] != State.CLOSED.value or listed:
                out.append(entry)
        return out

    def set_override(self, target: Target, action: str, reason: str, for_ms: int | None) -> bool:
        """An operator's override from this member's admin port: applied here at once
        (logged, counted), then written to the store for every member to follow (at the
        next sync, woken now; again after a failed one). ``force_closed`` and ``auto``
        also delete the fleet's record and reports of ``target``. False when ``target``
        has no breaker."""
        local, member = self.local, self.member
        ov = local.override_from(action, reason, for_ms, member.name)
        if not local.apply_override(target, ov, source="admin", reason=reason):
            return False
        metrics.OVERRIDES.labels(target.upstream, target.model, action).inc()
        now = member.now()
        if ov is None:
            record = OverrideRecord(AUTO, reason, None, None, now, member.name)
        else:
            until = None if for_ms is None else now + for_ms / 1000
            record = OverrideRecord(ov.action, ov.reason, until, for_ms, ov.at, ov.by)
        member.publish_override(target, record)
        return True

    def ramping(self, target: Target) -> bool:
        """Whether a skip of ``target`` is its own breaker's ramp (the fleet says call)."""
        member = self.member
        if admission(member.state(target), member.busy(target)) is Admission.SKIP:
            return False
        return self.local.ramping(target)

    def states(self) -> list[tuple[Target, BreakerState]]:
        """This member's own breakers (what a reload carries over)."""
        return self.local.states()

    def close(self) -> None:
        """Close the local breakers (the fleet outlives a generation)."""
        self.local.close()

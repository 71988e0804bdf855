"""The breakers on the event loop: the pure state machine plus its timer, logs and metrics.

:class:`LiveBreakers` owns one :class:`~sidecar.breakers.machine.Breakers` and the
injected :class:`~sidecar.clock.Clock`. Every call runs synchronously between
awaits (no locks). Each transition the state machine returns is logged
(``breaker_opened`` / ``breaker_half_open`` / ``breaker_closed``) and counted
once. The open -> half-open move happens on a timer at ``retry_at`` (contract:
"on a timer, not on the next request"), so ``/status``, the gauge and the logs
agree even when no request arrives.

With ``rate_limit_scope = "credential"`` it also holds the breakers of (target,
credential) (:attr:`LiveBreakers.credentials`, :mod:`sidecar.breakers.credentials`):
their moves are logged with the same events and a ``credential`` field (the first 8
hex digits of the credential's keyed hash), and counted nowhere (no metric carries a
credential, and ``sidecar_breaker_state`` / ``_transitions_total`` stay the target's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TypeGuard

from msgspec.structs import replace

from sidecar import logs, metrics
from sidecar.breakers.credentials import (
    CredentialBreakers,
    CredentialMove,
    credential_key,
    credential_of,
    short,
)
from sidecar.breakers.machine import (
    Breakers,
    BreakerSettings,
    BreakerState,
    Permit,
    State,
    Target,
    Transition,
    Verdict,
)
from sidecar.breakers.types import CredentialPermit
from sidecar.breakers.window import FailureWindow
from sidecar.clock import Clock, TimerHandle

_EVENTS = {
    State.OPEN: "breaker_opened",
    State.HALF_OPEN: "breaker_half_open",
    State.CLOSED: "breaker_closed",
}


def rfc3339(unix: float | None) -> str | None:
    """Unix seconds -> RFC 3339 UTC text (millisecond precision), None stays None."""
    if unix is None:
        return None
    return (
        datetime.fromtimestamp(unix, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


class LiveBreakers:
    """Breakers for the configured targets, with timer, logs and metrics; a
    :class:`~sidecar.breakers.port.BreakerPort`.

    :param settings: per-target settings; targets absent have no breaker.
    :param clock: the injected clock (monotonic seconds).
    :param initial: breaker states to keep (config reload), by target.
    :param windows: the failure-rate windows (see :class:`~sidecar.breakers.machine.Breakers`).
    :param scopes: per target whose upstream has ``rate_limit_scope = "credential"``, the
        header holding the credential (its ``auth_header``); others count rate limits
        against the target.
    :param carried: the credential breakers to keep (a reload): those of the targets
        in ``initial`` with the same header.
    """

    def __init__(
        self,
        settings: Mapping[Target, BreakerSettings],
        clock: Clock,
        initial: Mapping[Target, BreakerState] | None = None,
        windows: Mapping[Target, FailureWindow] | None = None,
        scopes: Mapping[Target, str] | None = None,
        carried: CredentialBreakers | None = None,
    ) -> None:
        self.clock = clock
        self.breakers = Breakers(settings, windows)
        self.credentials = CredentialBreakers(settings, scopes or {})
        """The breakers of (target, credential); the request path hashes a credential
        only while their :attr:`~CredentialBreakers.held` is not 0."""
        if carried is not None and initial:
            self.credentials.carry(carried, initial.keys())
        self._timer: TimerHandle | None = None
        self._timer_at: float | None = None
        self._closed = False
        if initial:
            self.breakers.restore(initial)
            self._schedule()
        metrics.init_breakers((t, s.state) for t, s in self.breakers.items())

    # -- the calls the proxy makes ------------------------------------------------

    def admit(self, target: Target) -> Permit | None:
        """A permit to call ``target`` now, or None to skip it (counted as a rejection, or
        as a ramp skip, ``sidecar_ramp_skips_total``, when a recovering target paces it)."""
        permit = self.breakers.admit(target, self.clock.now())
        due = self.breakers.drain_transitions()
        if due:
            self._emit(due)
        if permit is None:
            if self.ramping(target):
                metrics.RAMP_SKIPS.labels(target.upstream, target.model).inc()
            else:
                metrics.BREAKER_REJECTIONS.labels(target.upstream, target.model).inc()
        return permit

    def ramping(self, target: Target) -> bool:
        """Whether ``target`` is closed and in its ramp (``circuit_breaker.ramp_ms``): a
        skip of it now is a ramp skip (fallback reason ``ramp``), not an open breaker's."""
        return self.breakers.ramp(target, self.clock.now()) is not None

    def admit_credential(self, permit: Permit, headers: Mapping[str, str]) -> Permit | None:
        """``permit`` (from :meth:`admit`) once the breaker of (its target, the request's
        credential) admits it too, or None to skip the target for this request (its
        permit is then released). Called only while :attr:`credentials` holds any.

        :param headers: the request's headers (the upstream's ``auth_header`` is read).
        """
        checked = self.credential_permit(permit, headers)
        if checked is None:
            self.release(permit)
        return checked

    def credential_permit(self, permit: Permit, headers: Mapping[str, str]) -> Permit | None:
        """As :meth:`admit_credential`, without releasing ``permit`` on a refusal (the
        fleet's layer settles it its own way)."""
        creds = self.credentials
        target = permit.target
        if not creds.holds(target):
            return permit
        header = creds.header(target)
        assert header is not None  # holds() is False without one
        key = credential_key(credential_of(headers, header))
        cp, moves = creds.admit(target, key, self.clock.now())
        if moves:
            self._emit_credential(moves)
        return None if cp is None else replace(permit, credential=cp)

    def credential_skip(self, target: Target, headers: Mapping[str, str]) -> tuple[bool, float]:
        """Whether the breaker of (``target``, the request's credential) refuses calls now,
        and the seconds until it admits one (1.0 when unknown: every probe slot taken)."""
        header = self.credentials.header(target)
        if header is None or not self.credentials.holds(target):
            return False, 0.0
        key = credential_key(credential_of(headers, header))
        wait = self.credentials.retry_in(target, key, self.clock.now())
        if wait == 0.0:
            return False, 0.0
        return True, 1.0 if wait is None else wait

    def on_credential(self, permit: Permit, verdict: Verdict, rate_limit: bool) -> bool:
        """Whether a call's ``verdict`` counts against its credential's breaker instead of
        its target's: a rate-limit FAILURE on a target with ``rate_limit_scope =
        "credential"`` (the target's breaker then takes it as neutral)."""
        return (
            rate_limit
            and verdict is Verdict.FAILURE
            and self.credentials.header(permit.target) is not None
        )

    def lease_needed(self, permit: Permit | None) -> TypeGuard[Permit]:
        """Whether ``permit`` (from :meth:`admit`) must first take a lease (:meth:`lease`);
        only with ``[fleet]``, for a half-open fleet record. False for None."""
        return False

    async def lease(self, permit: Permit) -> Permit | None:
        """Take the fleet's probe lease for ``permit`` (only with ``[fleet]``; here: as is)."""
        return permit

    def may_continue(self, permit: Permit) -> bool:
        """Whether a call holding ``permit`` may retry (its breaker has not moved since)."""
        state = self.breakers.state(permit.target)
        if not (state is None or state.generation == permit.generation or permit.generation < 0):
            return False
        cp = permit.credential  # its credential's breaker has not opened meanwhile
        if cp is None:
            return True
        cs = self.credentials.state(permit.target, cp.key)
        return cs is None or cs.generation == cp.generation

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
        """Settle ``permit`` with ``verdict`` (once per candidate call); the target's moves
        made (logged and counted here).

        :param rate_limit: the verdict is a rate limit (:attr:`sidecar.judge.Judgement.rate_limit`):
            on a target with ``rate_limit_scope = "credential"`` it counts against the
            breaker of (target, the request's credential) and is neutral for the target.
        :param headers: the request's headers, where that credential is read (when the
            permit does not carry it already).
        """
        cp = permit.credential
        if rate_limit and self.on_credential(permit, verdict, rate_limit):
            if cp is None:
                header = self.credentials.header(permit.target)
                assert header is not None
                value = "" if headers is None else credential_of(headers, header)
                cp = CredentialPermit(credential_key(value), 0, False)
            moves = self.credentials.record(
                permit.target,
                cp,
                verdict,
                self.clock.now(),
                rate_limit=True,
                last_failure=last_failure,
                retry_after_s=retry_after_s,
            )
            if moves:
                self._emit_credential(moves)
            verdict, last_failure, retry_after_s = Verdict.NEUTRAL, None, None
        elif cp is not None:
            moves = self.credentials.record(
                permit.target, cp, verdict, self.clock.now(), rate_limit=False
            )
            if moves:
                self._emit_credential(moves)
        transitions = self.breakers.record(
            permit,
            verdict,
            self.clock.now(),
            last_failure=last_failure,
            retry_after_s=retry_after_s,
        )
        if transitions:
            self._emit(transitions)
        elif retry_after_s is not None:
            self._schedule()
        return transitions

    def release(self, permit: Permit) -> None:
        """Settle ``permit`` as neutral with no verdict (cancellation, unexpected error)."""
        self.breakers.release(permit)
        cp = permit.credential
        if cp is not None:
            self.credentials.release(permit.target, cp)

    def note_retry_after(self, target: Target, retry_after_s: float) -> None:
        """A failing answer asked for ``retry_after_s`` seconds: may extend an open breaker."""
        self.breakers.note_retry_after(target, retry_after_s, self.clock.now())
        self._schedule()

    def last_failure(self, target: Target) -> str | None:
        """The ``last_failure`` of ``target``'s breaker (None: none, or no breaker)."""
        state = self.breakers.state(target)
        return None if state is None else state.last_failure

    def retry_in(self, targets: Iterable[Target]) -> float | None:
        """Seconds until the soonest probe among ``targets``."""
        return self.breakers.retry_in(targets, self.clock.now())

    def force_close(self, target: Target) -> Transition | None:
        """Close an open or half-open ``target`` now (the fleet saw a probe succeed
        elsewhere), logged and counted; the move, or None when already closed."""
        moved = self.breakers.force_close(target, self.clock.now())
        if moved is not None:
            self._emit([moved])
        return moved

    # -- views -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (the breakers go quiet)."""
        return self._closed

    def state(self, target: Target) -> BreakerState | None:
        """``target``'s stored state, or None when it has no breaker."""
        return self.breakers.state(target)

    def states(self) -> list[tuple[Target, BreakerState]]:
        """A snapshot of every target that has a breaker, with its state."""
        return self.breakers.items()

    def status(self, all_targets: bool) -> list[dict[str, object]]:
        """``/status`` entries (contract fields), open, half-open and ramping ones unless
        ``all_targets``; a ramping target's entry adds ``ramp``, its current share (0-1).
        With ``all_targets``, the open and half-open breakers of (target, credential)
        follow, each with ``credential``: the first 8 hex digits of its keyed hash."""
        out: list[dict[str, object]] = []
        wall, now = self.clock.wall, self.clock.now()
        for target, st in sorted(self.breakers.items()):
            ramp = self.breakers.ramp(target, now)
            if not all_targets and st.state is State.CLOSED and ramp is None:
                continue
            entry: dict[str, object] = {
                "upstream": target.upstream,
                "model": target.model,
                "state": st.state.value,
                "consecutive_failures": st.consecutive_failures,
                "opened_at": rfc3339(None if st.opened_at is None else wall(st.opened_at)),
                "retry_at": rfc3339(None if st.retry_at is None else wall(st.retry_at)),
                "probes_in_flight": st.probes_in_flight,
                "last_failure": st.last_failure,
            }
            if ramp is not None:
                entry["ramp"] = round(ramp, 3)
            out.append(entry)
        if all_targets:
            out.extend(self._credential_status())
        return out

    def _credential_status(self) -> list[dict[str, object]]:
        moves = self.credentials.tick(self.clock.now())
        if moves:
            self._emit_credential(moves)
        wall = self.clock.wall
        return [
            {
                "upstream": target.upstream,
                "model": target.model,
                "credential": short(key),
                "state": st.state.value,
                "consecutive_failures": st.consecutive_failures,
                "opened_at": rfc3339(None if st.opened_at is None else wall(st.opened_at)),
                "retry_at": rfc3339(None if st.retry_at is None else wall(st.retry_at)),
                "probes_in_flight": st.probes_in_flight,
                "last_failure": st.last_failure,
            }
            for target, key, st in sorted(self.credentials.tripped())
        ]

    def close(self) -> None:
        """Cancel the timer and go quiet (shutdown or replacement by a reload).

        Results that still arrive from requests of a replaced generation change
        this instance only: no logs, metrics or timers, so they cannot contradict
        the new generation's breakers.
        """
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None

    # -- internals -------------------------------------------------------------------

    def _tick(self) -> None:
        self._timer = self._timer_at = None
        self._emit(self.breakers.tick(self.clock.now()))

    def _emit(self, transitions: list[Transition]) -> None:
        if self._closed:
            return
        for tr in transitions:
            t, st = tr.target, tr.state
            metrics.BREAKER_TRANSITIONS.labels(t.upstream, t.model, tr.to_state.value).inc()
            metrics.set_breaker_state(t, tr.to_state)
            logs.event(
                _EVENTS[tr.to_state],
                upstream=t.upstream,
                model=t.model,
                consecutive_failures=st.consecutive_failures,
                last_failure=st.last_failure,
                retry_at=rfc3339(None if st.retry_at is None else self.clock.wall(st.retry_at)),
            )
        self._schedule()

    def _emit_credential(self, moves: list[CredentialMove]) -> None:
        """Log the moves of (target, credential) breakers: the target's events, with the
        credential's short hash; no metric (a credential is never a label)."""
        if self._closed:
            return
        for mv in moves:
            t, st = mv.target, mv.state
            logs.event(
                _EVENTS[mv.to_state],
                upstream=t.upstream,
                model=t.model,
                credential=short(mv.key),
                consecutive_failures=st.consecutive_failures,
                last_failure=st.last_failure,
                retry_at=rfc3339(None if st.retry_at is None else self.clock.wall(st.retry_at)),
            )

    def _schedule(self) -> None:
        if self._closed:
            return
        when = self.breakers.next_deadline()
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = None if when is None else self.clock.call_at(when, self._tick)

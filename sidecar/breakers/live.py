"""The breakers on the event loop: the pure state machine plus its timer, logs and metrics.

:class:`LiveBreakers` owns one :class:`~sidecar.breakers.machine.Breakers` and the
injected :class:`~sidecar.clock.Clock`. Every call runs synchronously between
awaits (no locks). Each transition the state machine returns is logged
(``breaker_opened`` / ``breaker_half_open`` / ``breaker_closed``) and counted
once. The open -> half-open move happens on a timer at ``retry_at`` (contract:
"on a timer, not on the next request"), so ``/status``, the gauge and the logs
agree even when no request arrives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TypeGuard

from sidecar import logs, metrics
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
    """

    def __init__(
        self,
        settings: Mapping[Target, BreakerSettings],
        clock: Clock,
        initial: Mapping[Target, BreakerState] | None = None,
        windows: Mapping[Target, FailureWindow] | None = None,
    ) -> None:
        self.clock = clock
        self.breakers = Breakers(settings, windows)
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
        return state is None or state.generation == permit.generation or permit.generation < 0

    def record(
        self,
        permit: Permit,
        verdict: Verdict,
        *,
        last_failure: str | None = None,
        retry_after_s: float | None = None,
    ) -> Sequence[Transition]:
        """Settle ``permit`` with ``verdict`` (once per candidate call); the moves made
        (logged and counted here)."""
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
        ``all_targets``; a ramping target's entry adds ``ramp``, its current share (0-1)."""
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
        return out

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

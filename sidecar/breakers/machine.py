"""The circuit breaker: a pure state machine, one breaker per target.

Rules: ``interface.md``, section "The circuit breaker". A target is
``(upstream, candidate model or "*")`` and comes from the config only; a target
with no ``circuit_breaker`` table has no breaker and is always admitted.

Pure: no asyncio, no clock reads. Every method that decides on time takes ``now``,
monotonic seconds from the injected :class:`sidecar.clock.Clock`; all durations are
seconds. The IO layer calls :meth:`Breakers.tick` on a timer set at
:meth:`Breakers.next_deadline`, and logs and counts each :class:`Transition` it is
handed (every move is handed out exactly once).

State is a dict of frozen :class:`BreakerState` structs keyed by target; a change
reads the struct, computes the next one and stores it, synchronously on the event
loop, so no lock is needed. Every state move bumps ``generation``; a
:class:`Permit` carries the generation it was issued in, and an older one's result
is stale and changes nothing ("a result that arrives after the breaker has moved to
a newer state changes nothing"), except that a failing answer's ``Retry-After`` may
extend a breaker that is open when it arrives ("nothing shortens it, and it changes
nothing in other states").

A current permit's verdict moves the state by the table in ``_next``. By time:
open -> half_open once ``now >= retry_at`` (:meth:`Breakers.tick`, or
:meth:`Breakers.admit` when the timer is late). Opening sets ``retry_at = now +
max(cooldown_s, retry_after_s)``; the caller caps ``retry_after_s`` at the
upstream's ``retry_after_max_ms``.

Failure rate (``failure_rate_threshold`` > 0; contract, "Choosing among candidates"):
a closed breaker's successes and failures (not its neutral calls) are also counted in
the target's :class:`~sidecar.breakers.window.FailureWindow`, and a failure that leaves
the consecutive count short opens the breaker when the window holds at least
``minimum_calls`` calls of which at least that share failed. Either rule opens it;
every move to closed empties the window.

Paced recovery (``ramp_s`` > 0; contract, "Choosing among candidates"): after a probe
closes the breaker, it admits a growing share of the calls, ``max(0.1, t / ramp_s)``
at ``t`` seconds after the close (:func:`ramp_share`), paced by a credit (no random
draw), the rest skipped as if open; a failure during the ramp reopens it at once.

Operator overrides (contract, "The admin port", ``POST /breakers/{upstream}/{model}``;
:meth:`Breakers.override`) live in the state itself (``BreakerState.override``), so the
admit path reads nothing more: a forced-open breaker is ``open`` with no ``retry_at``
(never due, so never probed), a forced-closed one is ``closed`` and the failure branch of
the transition table leaves it closed. An override with an end (``until``) is ended on
the same timer as the cooldowns (:meth:`Breakers.next_deadline`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from msgspec.structs import replace

from sidecar.breakers.types import (
    BreakerSettings,
    BreakerState,
    Override,
    Permit,
    State,
    Target,
    Transition,
    Verdict,
)
from sidecar.breakers.window import FailureWindow

__all__ = [
    "INITIAL",
    "BreakerSettings",
    "BreakerState",
    "Breakers",
    "Override",
    "Permit",
    "State",
    "Target",
    "Transition",
    "Verdict",
    "next_state",
    "to_half_open",
]


_INITIAL = BreakerState(State.CLOSED, 0, 0, 0, 0, None, None, None)
INITIAL = _INITIAL
"""A new breaker's state: closed, generation 0, no failures."""


def _move(s: BreakerState, to: State, **changes: float | None) -> BreakerState:
    """A state move: bumps the generation (old permits turn stale), empties probe counts."""
    generation = s.generation + 1
    return replace(
        s, state=to, generation=generation, probe_successes=0, probes_in_flight=0, **changes
    )


def _to_open(s: BreakerState, cfg: BreakerSettings, now: float, ra: float | None) -> BreakerState:
    """Open for a cooldown, or longer when the failing answer's Retry-After (``ra``) asks."""
    retry_at = now + max(cfg.cooldown_s, ra or 0.0)
    return _move(s, State.OPEN, opened_at=now, retry_at=retry_at, closed_at=None)


def _to_closed(s: BreakerState, cfg: BreakerSettings, now: float) -> BreakerState:
    """Close (a probe succeeded, or the fleet saw one): counts reset; with ``ramp_s`` the
    ramp starts ``now``."""
    closed_at = now if cfg.ramp_s > 0 else None
    return _move(
        s, State.CLOSED, consecutive_failures=0, opened_at=None, retry_at=None, closed_at=closed_at
    )


def ramp_share(s: BreakerState, cfg: BreakerSettings, now: float) -> float | None:
    """The share of calls a closed breaker admits during its ramp, ``max(0.1, t / ramp_s)``
    at ``t`` seconds after the close (contract, "Paced recovery"); None when not ramping."""
    closed_at = s.closed_at
    if closed_at is None or s.state is not State.CLOSED:
        return None
    t = now - closed_at
    ramp_s = cfg.ramp_s
    if not t < ramp_s:
        return None
    return max(0.1, t / ramp_s)


def _failed(s: BreakerState, last_failure: str | None) -> BreakerState:
    last = last_failure if last_failure is not None else s.last_failure
    return replace(s, consecutive_failures=s.consecutive_failures + 1, last_failure=last)


def _free_slot(s: BreakerState) -> BreakerState:
    return replace(s, probes_in_flight=max(0, s.probes_in_flight - 1))


def _next(
    s: BreakerState,
    verdict: Verdict,
    cfg: BreakerSettings,
    now: float,
    last_failure: str | None,
    retry_after: float | None,
) -> BreakerState:
    """The transition table: what a *current* permit's verdict does in each state."""
    match s.state, verdict:
        case State.CLOSED, Verdict.SUCCESS:
            return replace(s, consecutive_failures=0)
        case State.CLOSED, Verdict.FAILURE:
            ramping = ramp_share(s, cfg, now) is not None  # a failure then reopens at once
            s = _failed(s, last_failure)
            opens = ramping or s.consecutive_failures >= cfg.failure_threshold
            if opens and s.override is not None:  # forced closed: counted, never opens
                return s
            return _to_open(s, cfg, now, retry_after) if opens else s
        case State.HALF_OPEN, Verdict.SUCCESS:
            s = replace(_free_slot(s), probe_successes=s.probe_successes + 1)
            if s.probe_successes < cfg.success_threshold:
                return s
            return _to_closed(s, cfg, now)
        case State.HALF_OPEN, Verdict.FAILURE:
            return _to_open(_failed(s, last_failure), cfg, now, retry_after)
        case State.HALF_OPEN, Verdict.NEUTRAL:
            return _free_slot(s)
        case _:
            # closed NEUTRAL: nothing. OPEN: impossible (admit hands out no permit while
            # open), so it leaves the state untouched.
            return s


next_state = _next
"""The transition table (:func:`_next`), for the breakers of (target, credential)
(:mod:`sidecar.breakers.credentials`), which follow the same rules."""


def to_half_open(s: BreakerState) -> BreakerState:
    """The open -> half_open move (its cooldown ended): a new generation, no probes yet."""
    return _move(s, State.HALF_OPEN)


class Breakers:
    """Every target's breaker. Targets come from ``settings`` (the config) only.

    :param windows: the failure-rate window of each target whose settings have
        ``failure_rate`` > 0, when the caller keeps them (a reload carries a kept
        target's window, :class:`sidecar.generation.Generation`); None: made here. A
        target with ``failure_rate`` > 0 and no window given gets a new one.
    """

    def __init__(
        self,
        settings: Mapping[Target, BreakerSettings],
        windows: Mapping[Target, FailureWindow] | None = None,
    ) -> None:
        self._settings: dict[Target, BreakerSettings] = dict(settings)
        self._states: dict[Target, BreakerState] = {t: _INITIAL for t in self._settings}
        given = windows or {}
        self._windows: dict[Target, FailureWindow] = {
            t: given.get(t) or FailureWindow(cfg.window_s)
            for t, cfg in self._settings.items()
            if cfg.failure_rate > 0
        }
        """The failure-rate windows of the targets with ``failure_rate`` > 0."""
        self._pending: list[Transition] = []
        self._ramp_credit: dict[Target, float] = {}
        """Per ramping target: the admitted share accumulated since its last admitted call."""

    def restore(self, states: Mapping[Target, BreakerState]) -> None:
        """Carry states over on a config reload (only for targets with a breaker here),
        exactly as they are: generation, counts, ``retry_at`` and the half-open probe
        slots in flight (contract, "Reload": a reload never lets a second probe
        through). The old generation's permits settle here
        (:meth:`sidecar.generation.Runtime.retire`), so their slots are freed here."""
        for target, s in states.items():
            if target in self._states:
                self._states[target] = s

    def has(self, target: Target) -> bool:
        """Whether ``target`` has a breaker."""
        return target in self._states

    def state(self, target: Target) -> BreakerState | None:
        """``target``'s stored state, or None when it has no breaker."""
        return self._states.get(target)

    def items(self) -> list[tuple[Target, BreakerState]]:
        """A snapshot of every target that has a breaker, with its state."""
        return list(self._states.items())

    def _store(self, target: Target, old: BreakerState, new: BreakerState) -> Transition | None:
        self._states[target] = new
        if new.state is old.state:
            return None
        if new.state is State.CLOSED:
            window = self._windows.get(target)
            if window is not None:  # "the window starts empty again on every close"
                window.reset()
            self._ramp_credit.pop(target, None)
        return Transition(target, old.state, new.state, new)

    def _due(self, target: Target, now: float) -> Transition | None:
        """Move ``target`` open -> half_open if its open period has ended by ``now``."""
        s = self._states[target]
        if s.state is State.OPEN and s.retry_at is not None and now >= s.retry_at:
            return self._store(target, s, _move(s, State.HALF_OPEN))
        return None

    def admit(self, target: Target, now: float) -> Permit | None:
        """A permit to call ``target``, or None to skip it (open, or half-open and full).

        In half_open the permit is a probe and takes a slot. If the open period has
        ended but the timer has not fired yet, the open -> half_open move is made
        here and queued for :meth:`drain_transitions`.
        """
        if target not in self._states:
            return Permit(target, -1, False)
        moved = self._due(target, now)
        if moved is not None:
            self._pending.append(moved)
        s = self._states[target]
        if s.state is State.CLOSED:
            if s.closed_at is not None and not self._ramp_admits(target, s, now):
                return None
            return Permit(target, s.generation, False)
        full = s.probes_in_flight >= self._settings[target].half_open_max_probes
        if s.state is State.HALF_OPEN and not full:
            self._states[target] = replace(s, probes_in_flight=s.probes_in_flight + 1)
            return Permit(target, s.generation, True)
        return None

    def _ramp_admits(self, target: Target, s: BreakerState, now: float) -> bool:
        """Whether a closed, recently closed target admits this call: during its ramp the
        calls are paced, not drawn: each adds the current share to a credit and one is
        admitted whenever the credit reaches 1 (so exactly that share gets through)."""
        share = ramp_share(s, self._settings[target], now)
        if share is None:  # the ramp is over (or off): later calls skip this step
            self._states[target] = replace(s, closed_at=None)
            return True
        credit = self._ramp_credit.get(target, 0.0) + share
        if credit >= 1.0 - 1e-9:  # ten shares of 0.1 add up to 0.999...
            self._ramp_credit[target] = credit - 1.0
            return True
        self._ramp_credit[target] = credit
        return False

    def ramp(self, target: Target, now: float) -> float | None:
        """``target``'s current ramp share (0.1 to 1) while it ramps, else None."""
        s = self._states.get(target)
        if s is None:
            return None
        return ramp_share(s, self._settings[target], now)

    def record(
        self,
        permit: Permit,
        verdict: Verdict,
        now: float,
        *,
        last_failure: str | None = None,
        retry_after_s: float | None = None,
    ) -> list[Transition]:
        """Settle ``permit`` with the verdict of its candidate call (once, after retries).

        ``last_failure`` (``connect_error``, ``http_503``, ...) is stored on a FAILURE;
        ``retry_after_s`` is the failing answer's Retry-After, capped by the caller.
        Returns the move made, if any. A stale permit changes nothing, except that a
        FAILURE's ``retry_after_s`` extends a breaker that is open when it arrives.
        """
        target = permit.target
        s = self._states.get(target)
        if s is None:
            return []
        if s.state is State.OPEN:
            if verdict is Verdict.FAILURE and retry_after_s is not None:
                self.note_retry_after(target, retry_after_s, now)
            return []
        if permit.generation != s.generation or permit.probe != (s.state is State.HALF_OPEN):
            return []
        cfg = self._settings[target]
        new = _next(s, verdict, cfg, now, last_failure, retry_after_s)
        if s.state is State.CLOSED and verdict is not Verdict.NEUTRAL and self._windows:
            window = self._windows.get(target)
            if window is not None:  # neutral calls are not counted
                failed = verdict is Verdict.FAILURE
                window.record(failed, now)
                opens = failed and new.state is State.CLOSED and new.override is None
                if opens and window.opens(cfg.failure_rate, cfg.minimum_calls):
                    new = _to_open(new, cfg, now, retry_after_s)
        moved = self._store(target, s, new)
        return [] if moved is None else [moved]

    def release(self, permit: Permit) -> None:
        """Settle ``permit`` with no verdict (cancellation, a bug): frees a current probe's slot."""
        s = self._states.get(permit.target)
        if s is None or not permit.probe or permit.generation != s.generation:
            return
        if s.state is State.HALF_OPEN:
            self._states[permit.target] = _free_slot(s)

    def note_retry_after(self, target: Target, retry_after_s: float, now: float) -> None:
        """Extend an open, not yet due breaker to ``now + retry_after_s``; never shortens."""
        s = self._states.get(target)
        if s is None or s.state is not State.OPEN or s.retry_at is None or now >= s.retry_at:
            return
        if now + retry_after_s > s.retry_at:
            self._states[target] = replace(s, retry_at=now + retry_after_s)

    def force_close(self, target: Target, now: float) -> Transition | None:
        """Close an open or half-open ``target`` at ``now``, as a successful probe would
        (the fleet saw one succeed elsewhere: every member ramps from then); returns the
        move, None when already closed.

        Permits of the old state turn stale (the generation moves on).
        """
        s = self._states.get(target)
        if s is None or s.state is State.CLOSED or s.override is not None:
            return None  # an operator's force_open is ended by the operator (or its expiry)
        return self._store(target, s, _to_closed(s, self._settings[target], now))

    # -- operator overrides (contract, "The admin port": POST /breakers/...) ----------

    def override(self, target: Target, ov: Override | None, now: float) -> Transition | None:
        """Put ``target`` under the operator's override ``ov``, or end any (``None``:
        ``auto``); returns the state move made, if any (a forced close of a closed
        breaker moves nothing). Every call starts a new generation: permits issued
        before turn stale (a call between retries makes no further retry there).

        - ``force_open``: open with no ``retry_at`` (no probe is ever due), the
          failure count and ``last_failure`` kept, until ``auto`` or ``ov.until``;
        - ``force_closed``: closed (no ramp), the failure count kept; failures are still
          counted (:meth:`record`) but never open it;
        - ``None`` (``auto``): closed with its counts reset and its failure-rate window
          emptied: the breaker's own rules from here on.

        :raises KeyError: ``target`` has no breaker (the caller checks :meth:`has`).
        """
        s = self._states[target]
        base = replace(s, generation=s.generation + 1, probe_successes=0, probes_in_flight=0)
        if ov is None:
            new = replace(
                base,
                state=State.CLOSED,
                consecutive_failures=0,
                opened_at=None,
                retry_at=None,
                closed_at=None,
                override=None,
            )
            window = self._windows.get(target)
            if window is not None:
                window.reset()
            self._ramp_credit.pop(target, None)
        elif ov.forces_open:
            opened_at = s.opened_at if s.state is State.OPEN else now
            new = replace(
                base,
                state=State.OPEN,
                opened_at=opened_at,
                retry_at=None,
                closed_at=None,
                override=ov,
            )
        else:
            new = replace(
                base, state=State.CLOSED, opened_at=None, retry_at=None, closed_at=None, override=ov
            )
        return self._store(target, s, new)

    def expire_overrides(self, now: float) -> list[tuple[Target, Override, Transition | None]]:
        """End every override whose ``until`` has come by ``now``, as ``auto`` does; each
        ended override with the move its end made (None when it moved nothing)."""
        out: list[tuple[Target, Override, Transition | None]] = []
        for target, s in list(self._states.items()):
            ov = s.override
            if ov is not None and ov.until is not None and now >= ov.until:
                out.append((target, ov, self.override(target, None, now)))
        return out

    def tick(self, now: float) -> list[Transition]:
        """Move every open target whose ``retry_at <= now`` to half_open; the moves made."""
        moves = [self._due(t, now) for t in list(self._states)]
        return [m for m in moves if m is not None]

    def next_deadline(self) -> float | None:
        """The soonest ``retry_at`` among open targets, or end of an override (when to
        call :meth:`expire_overrides` and :meth:`tick`)."""
        due = [s.retry_at for s in self._states.values() if s.state is State.OPEN]
        ends = [s.override.until for s in self._states.values() if s.override is not None]
        return min((t for t in (*due, *ends) if t is not None), default=None)

    def drain_transitions(self) -> list[Transition]:
        """The open -> half_open moves :meth:`admit` made itself since the last drain."""
        pending, self._pending = self._pending, []
        return pending

    def retry_in(self, targets: Iterable[Target], now: float) -> float | None:
        """Seconds (>= 0) until the soonest of ``targets`` allows a call, for Retry-After.

        Open: until ``retry_at``; forced open: until the override ends, or one cooldown
        when it has no end; closed, half-open with a free slot, or no breaker: 0.
        A half-open target with every slot taken is unknown; None if all are unknown.
        """
        waits: list[float] = []
        for target in targets:
            s = self._states.get(target)
            if s is None or s.state is State.CLOSED:
                waits.append(0.0)
            elif s.override is not None:  # forced open: until its end, else one cooldown
                end = s.override.until
                cooldown = self._settings[target].cooldown_s
                waits.append(cooldown if end is None else max(0.0, end - now))
            elif s.state is State.OPEN:
                waits.append(max(0.0, (now if s.retry_at is None else s.retry_at) - now))
            elif s.probes_in_flight < self._settings[target].half_open_max_probes:
                waits.append(0.0)
        return min(waits, default=None)

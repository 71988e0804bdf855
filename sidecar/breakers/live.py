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

Operators' overrides (``POST /breakers/...``, :mod:`sidecar.admin_breakers`) are
applied here (:meth:`LiveBreakers.apply_override`): logged as ``breaker_override``,
``sidecar_breaker_override_active`` set, the state move logged and counted as any; an
override's end runs on the same timer as the cooldowns (``breaker_override_expired``).
"""

from __future__ import annotations

import os
import socket
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
    Override,
    Permit,
    State,
    Target,
    Transition,
    Verdict,
)
from sidecar.breakers.types import AUTO, CredentialPermit
from sidecar.breakers.window import FailureWindow
from sidecar.clock import Clock, TimerHandle

_EVENTS = {
    State.OPEN: "breaker_opened",
    State.HALF_OPEN: "breaker_half_open",
    State.CLOSED: "breaker_closed",
}


def this_member() -> str:
    """``<HOSTNAME>/<pid>`` of this process (the fleet's member name)."""
    host = os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host}/{os.getpid()}"


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
    :param overrides: operators' overrides to keep on targets whose breaker a reload
        reset (changed settings): applied to the new breaker as they were, end included.
    """

    def __init__(
        self,
        settings: Mapping[Target, BreakerSettings],
        clock: Clock,
        initial: Mapping[Target, BreakerState] | None = None,
        windows: Mapping[Target, FailureWindow] | None = None,
        scopes: Mapping[Target, str] | None = None,
        carried: CredentialBreakers | None = None,
        overrides: Mapping[Target, Override] | None = None,
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
        self.member = this_member()
        """Who takes this member's overrides (``by``): ``<HOSTNAME>/<pid>``, as the fleet
        names members."""
        if initial:
            self.breakers.restore(initial)
        for target, ov in (overrides or {}).items():  # a reload reset these breakers
            st = self.breakers.state(target)
            if st is not None and st.override is None:
                self.breakers.override(target, ov, clock.now())
        if initial or overrides:
            self._schedule()
        metrics.init_breakers((t, s.state) for t, s in self.breakers.items())
        metrics.init_overrides((t, s.override) for t, s in self.breakers.items())

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
        if state is None or (state.override is not None and state.state is State.OPEN):
            return None  # skipped by the operator's force_open: 503 circuit_open, never 429
        return state.last_failure

    def retry_in(self, targets: Iterable[Target]) -> float | None:
        """Seconds until the soonest probe among ``targets``."""
        return self.breakers.retry_in(targets, self.clock.now())

    def override_from(
        self, action: str, reason: str, for_ms: int | None, by: str
    ) -> Override | None:
        """The :class:`Override` an operator's ``action`` makes now (``None`` for
        ``auto``); ``for_ms`` (milliseconds, > 0) ends it by itself then."""
        if action == AUTO:
            return None
        now = self.clock.now()
        until = None if for_ms is None else now + for_ms / 1000
        return Override(action, reason, until, for_ms, self.clock.wall(now), by)

    def override_at(
        self,
        action: str,
        reason: str,
        until_wall: float | None,
        for_ms: int | None,
        at: float,
        by: str,
    ) -> Override:
        """An override another member took (its end ``until_wall`` in Unix seconds), on
        this member's clock."""
        now = self.clock.now()
        until = None if until_wall is None else now + (until_wall - self.clock.wall(now))
        return Override(action, reason, until, for_ms, at, by)

    def apply_override(
        self, target: Target, ov: Override | None, *, source: str, reason: str = ""
    ) -> bool:
        """Put ``target`` under ``ov`` (``None``: ``auto``, back to the breaker's own
        rules, closed with its counts reset): logged as ``breaker_override`` (with
        ``source``: ``admin`` for this member's admin port, ``fleet`` for one taken on
        another member), the ``sidecar_breaker_override_active`` gauge set, the state
        move logged and counted as any. ``reason``: the ``auto``'s reason (an override's
        own is in ``ov``). False (nothing done) when ``target`` has no breaker."""
        if not self.breakers.has(target) or self._closed:
            return False
        logs.event(
            "breaker_override",
            upstream=target.upstream,
            model=target.model,
            action=AUTO if ov is None else ov.action,
            reason=reason if ov is None else ov.reason,
            for_ms=None if ov is None else ov.for_ms,
            until=None if ov is None or ov.until is None else rfc3339(self.clock.wall(ov.until)),
            source=source,
            by=None if ov is None else ov.by,
        )
        moved = self.breakers.override(target, ov, self.clock.now())
        metrics.set_override_active(target, None if ov is None else ov.action)
        if moved is not None:
            self._emit([moved])
        else:
            self._schedule()
        return True

    def set_override(self, target: Target, action: str, reason: str, for_ms: int | None) -> bool:
        """An operator's override from the admin port (:meth:`apply_override`, ``source``
        ``admin``), counted in ``sidecar_breaker_overrides_total``; False when ``target``
        has no breaker."""
        ov = self.override_from(action, reason, for_ms, self.member)
        if not self.apply_override(target, ov, source="admin", reason=reason):
            return False
        metrics.OVERRIDES.labels(target.upstream, target.model, action).inc()
        return True

    def override(self, target: Target) -> Override | None:
        """The override in force on ``target`` (None: none, or no breaker)."""
        st = self.breakers.state(target)
        return None if st is None else st.override

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
            ov = st.override
            if not all_targets and st.state is State.CLOSED and ramp is None and ov is None:
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
            if ov is not None:
                entry["override"] = self.override_entry(ov)
            out.append(entry)
        if all_targets:
            out.extend(self._credential_status())
        return out

    def override_entry(self, ov: Override) -> dict[str, object]:
        """``/status``'s ``override`` of an entry: ``action``, ``reason``, ``until``
        (RFC 3339, null for none), ``for_ms``, ``set_at`` (RFC 3339) and ``by`` (the
        member whose admin port took it)."""
        wall = self.clock.wall
        return {
            "action": ov.action,
            "reason": ov.reason,
            "until": None if ov.until is None else rfc3339(wall(ov.until)),
            "for_ms": ov.for_ms,
            "set_at": rfc3339(ov.at),
            "by": ov.by,
        }

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
        now = self.clock.now()
        moves = []
        for target, ov, moved in self.breakers.expire_overrides(now):
            metrics.set_override_active(target, None)
            logs.event(
                "breaker_override_expired",
                upstream=target.upstream,
                model=target.model,
                action=ov.action,
                reason=ov.reason,
                for_ms=ov.for_ms,
                by=ov.by,
            )
            if moved is not None:
                moves.append(moved)
        self._emit(moves + self.breakers.tick(now))

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

"""The circuit breaker's data (pure): states, verdicts, targets, settings, permits, moves.

The state machine that reads and writes them is :mod:`sidecar.breakers.machine`, which
re-exports every name here.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import msgspec

__all__ = [
    "ACTIONS",
    "AUTO",
    "FORCE_CLOSED",
    "FORCE_OPEN",
    "BreakerSettings",
    "BreakerState",
    "CredentialPermit",
    "Override",
    "Permit",
    "State",
    "Target",
    "Transition",
    "Verdict",
]


class State(enum.Enum):
    """A breaker's state."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Verdict(enum.Enum):
    """What one candidate call (after its retries) means for its breaker."""

    SUCCESS = "success"
    FAILURE = "failure"
    NEUTRAL = "neutral"


class Target(NamedTuple):
    """What a breaker guards: an upstream name and the candidate's model (``"*"`` if none)."""

    upstream: str
    model: str


class BreakerSettings(msgspec.Struct, frozen=True):
    """One target's ``circuit_breaker`` settings, with the cooldown and window in seconds.

    ``failure_rate`` (0 to 1; 0 = off) is ``failure_rate_threshold``: with it the
    breaker also opens when the last ``window_s`` seconds hold at least
    ``minimum_calls`` calls of which that share failed
    (:class:`~sidecar.breakers.window.FailureWindow`).
    """

    failure_threshold: int
    cooldown_s: float
    half_open_max_probes: int
    success_threshold: int
    failure_rate: float = 0.0
    window_s: float = 60.0
    minimum_calls: int = 20
    ramp_s: float = 0.0
    """``ramp_ms`` in seconds (0 = off): after a probe closes the breaker, the share of
    calls it admits grows from 0.1 to 1 over this long."""

    def __post_init__(self) -> None:
        counts = (
            self.failure_threshold,
            self.half_open_max_probes,
            self.success_threshold,
            self.minimum_calls,
        )
        if min(counts) < 1 or not self.cooldown_s > 0 or not self.window_s > 0:
            raise ValueError("breaker thresholds, probe counts, cooldown and window must be > 0")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be between 0 and 1")
        if not self.ramp_s >= 0:
            raise ValueError("ramp_s must be >= 0")


class Override(msgspec.Struct, frozen=True):
    """An operator's override of one target's breaker (contract, "The admin port",
    ``POST /breakers/{upstream}/{model}``), kept in the target's :class:`BreakerState`.

    ``action``: ``force_open`` (skipped as if open, no probe) or ``force_closed``
    (admitted whatever its failures, which are still counted). ``until``: when it ends
    by itself (monotonic seconds of the injected clock), None for never (until
    ``auto``); ``for_ms`` is the duration asked for, as given. ``at`` (Unix seconds) and
    ``by`` (the member that took it, ``<HOSTNAME>/<pid>``) name it: with the fleet on,
    a member tells an override it already follows from a newer one by them.
    """

    action: str
    reason: str
    until: float | None
    for_ms: int | None
    at: float
    by: str

    @property
    def forces_open(self) -> bool:
        """True for ``force_open``."""
        return self.action == FORCE_OPEN


FORCE_OPEN = "force_open"
FORCE_CLOSED = "force_closed"
AUTO = "auto"
ACTIONS = (FORCE_OPEN, FORCE_CLOSED, AUTO)
"""The override actions, as the endpoint takes them and metrics label them."""


class BreakerState(msgspec.Struct, frozen=True):
    """One target's breaker, as stored; times are monotonic seconds.

    ``opened_at``/``retry_at``: when it last opened and when a probe is allowed
    (kept through half_open, cleared on close). ``consecutive_failures`` is kept
    while open and half_open (for ``/status``) and reset on close (an operator's
    ``force_closed`` keeps it). ``closed_at``: when a probe (or the fleet) last closed
    it, for the paced recovery of ``ramp_s``; None until then and while open or
    half_open.
    """

    state: State
    generation: int
    consecutive_failures: int
    probe_successes: int
    probes_in_flight: int
    opened_at: float | None
    retry_at: float | None
    last_failure: str | None
    closed_at: float | None = None
    override: Override | None = None
    """An operator's override in force (:class:`Override`), else None. A forced-open
    breaker is ``open`` with no ``retry_at`` (no probe is ever due); a forced-closed one
    is ``closed`` and never opens; the admit path reads nothing more."""


class CredentialPermit(msgspec.Struct, frozen=True):
    """The part of a :class:`Permit` that the breaker of (target, credential) gave
    (:mod:`sidecar.breakers.credentials`): ``key`` is the credential's keyed hash;
    ``generation`` the state's it was issued in (0 when the credential had no breaker:
    a new one starts closed at 0); a ``probe`` holds one of its half-open slots."""

    key: bytes
    generation: int
    probe: bool


class Permit(msgspec.Struct, frozen=True):
    """Leave to call a target once; settle it once, with ``record`` or ``release``.

    A ``probe`` holds a half-open probe slot; ``generation`` is -1 with no breaker.
    ``credential``: what the request's credential breaker said (``rate_limit_scope =
    "credential"``), None when it was not asked (no breaker of that target's credentials
    held anything when the call was admitted).
    """

    target: Target
    generation: int
    probe: bool
    credential: CredentialPermit | None = None


class Transition(msgspec.Struct, frozen=True):
    """A state move, for logs and metrics; ``state`` is the new state after the move."""

    target: Target
    from_state: State
    to_state: State
    state: BreakerState

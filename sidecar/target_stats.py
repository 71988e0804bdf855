"""What the chooser knows of one target: calls in flight and recent time to first output.

One :class:`TargetStats` per target of a route with tiers (contract, "Choosing among
candidates") or with a failure-rate breaker, kept beside the breaker state and, like
it, changed synchronously on
the event loop by the request path (no lock): ``in_flight`` goes up when a candidate
call starts on the target and down when it settles, and every successful call's time
to first output feeds :attr:`TargetStats.ttfo_s`.

Pure: times are monotonic seconds handed in by the caller from the injected clock.
"""

from __future__ import annotations

import math

from sidecar.breakers.window import FailureWindow

__all__ = ["TTFO_TAU_S", "TargetStats"]

TTFO_TAU_S = 5.0
"""Time constant of the time-to-first-output average, in seconds: a sample's weight is
``1 - exp(-dt / TTFO_TAU_S)`` after ``dt`` seconds without one, so the average follows
a change of speed within a few multiples of it (95 % after 15 s, whatever the
traffic), and a member that got no calls for long takes its next sample nearly whole.
The contract asks a member three times slower than its peers to be down to a quarter
of new calls within 30 s."""


class TargetStats:
    """One target's load, as the chooser (:mod:`sidecar.choice`) reads it."""

    __slots__ = ("capacity", "in_flight", "sampled_at", "ttfo_s", "window")

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        """The target's upstream's ``max_connections`` (0: no limit): when
        :attr:`in_flight` reaches it, the chooser asks whether the pool is full."""
        self.in_flight = 0
        """Candidate calls to the target on routes with tiers, started and not yet
        settled (retries included); a plain route's calls to the same target are not
        counted."""
        self.ttfo_s: float | None = None
        """Recent time to first output in seconds (an exponentially weighted moving
        average over time, :data:`TTFO_TAU_S`); None before the first sample."""
        self.sampled_at = 0.0
        """When :attr:`ttfo_s` last took a sample (monotonic seconds)."""
        self.window: FailureWindow | None = None
        """The breaker's failure-rate window (``failure_rate_threshold`` > 0), kept
        here so that a reload that keeps the breaker keeps its window too."""

    def first_output(self, seconds: float, now: float) -> None:
        """Take a successful call's time to first output (``seconds``) at ``now``."""
        avg = self.ttfo_s
        if avg is None:
            self.ttfo_s = seconds
        else:
            a = 1.0 - math.exp(-max(0.0, now - self.sampled_at) / TTFO_TAU_S)
            self.ttfo_s = avg + a * (seconds - avg)
        self.sampled_at = now

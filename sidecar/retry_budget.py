"""The retry budget of one upstream: how many retries may be in flight to it now.

Contract, "Bounding the load that failures add": a retry (or a hedge) on an upstream
starts only while the retries and hedges in flight to it are fewer than
``max(min_retry_concurrency, budget_percent % of the requests in flight to it)``;
otherwise the candidate call ends with the failure it has and the request falls back.
This is Envoy's retry budget (``retry_budget``: ``budget_percent``, default 20 %, and
``min_retry_concurrency``, default 3), counted per upstream as Envoy counts per cluster.

One :class:`RetryBudget` per upstream (:class:`sidecar.upstream.Upstream.budget`),
changed synchronously on the event loop by the request path (no lock), like
:class:`sidecar.target_stats.TargetStats`: :attr:`RetryBudget.requests` goes up when a
candidate call starts on the upstream and down when it ends; :attr:`RetryBudget.retries`
goes up when a retry is granted (before its backoff wait: a retry waiting for its turn
will reach the upstream) and down when that retry's attempt ends. Pure: no IO, no clock.
"""

from __future__ import annotations

__all__ = ["RetryBudget"]


class RetryBudget:
    """The in-flight counts of one upstream and its budget's two settings.

    :param percent: ``retry.budget_percent`` (0..100): retries in flight may reach this
        share of the requests in flight.
    :param minimum: ``retry.min_retry_concurrency`` (>= 0): retries in flight allowed
        whatever the share (a quiet upstream can still retry).
    """

    __slots__ = ("minimum", "ratio", "requests", "retries")

    def __init__(self, percent: float, minimum: int) -> None:
        self.ratio = percent / 100
        """``budget_percent`` as a fraction."""
        self.minimum = minimum
        self.requests = 0
        """Candidate calls to the upstream in flight (a call waiting to retry included)."""
        self.retries = 0
        """Retries (and hedges) to the upstream in flight: granted and not yet ended."""

    def allows(self) -> bool:
        """Whether one more retry may start now: the retries in flight are fewer than
        ``max(minimum, percent % of the requests in flight)``."""
        retries = self.retries
        return retries < self.minimum or retries < self.ratio * self.requests

    def take(self) -> bool:
        """Grant one retry when :meth:`allows` says so (then counted in :attr:`retries`
        until :meth:`give_back`); False: no budget left, nothing counted."""
        if self.allows():
            self.retries += 1
            return True
        return False

    def give_back(self) -> None:
        """A retry granted by :meth:`take` ended (its attempt answered, failed or was cut)."""
        self.retries -= 1

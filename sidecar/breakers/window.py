"""The failure-rate window of one breaker: calls and failures over the last ``window_ms``.

Contract, "Choosing among candidates" ("Failure rate"): the breaker also opens when
the last ``window_ms`` hold at least ``minimum_calls`` recorded candidate calls and
the share of failures among them is at least ``failure_rate_threshold``; neutral
calls are not counted; the window starts empty again on every close; the cost of
recording stays constant per call, whatever the traffic.

The rule is the sliding time window of resilience4j's ``TIME_BASED`` sliding window
(``slidingWindowSize`` seconds in one-second buckets, ``minimumNumberOfCalls``,
``failureRateThreshold``) and of Envoy's ``outlier_detection`` success-rate and
failure-percentage ejection (an interval's counts, ``*_minimum_hosts``/
``*_request_volume``). Here the window is :data:`BUCKETS` time buckets of
``window_s / BUCKETS`` each, in a ring: recording adds to the current bucket (after
emptying the buckets that fell out of the window since the last call: at most
:data:`BUCKETS` steps, however long the gap), and the totals are kept as running sums,
so a call costs the same at 1 or 10,000 calls per second. The window covers between
``window_s - window_s / BUCKETS`` and ``window_s`` seconds back (the oldest bucket
leaves whole), as resilience4j's epoch-second buckets do.

Pure: no clock reads; ``now`` is monotonic seconds from the injected clock.
"""

from __future__ import annotations

import math

__all__ = ["BUCKETS", "FailureWindow"]

BUCKETS = 10
"""Time buckets per window (a ``window_ms`` of 60 s: 6-second buckets)."""


class FailureWindow:
    """Calls and failures recorded over the last ``window_s`` seconds.

    :param window_s: the window's length in seconds (``window_ms`` / 1000), > 0.
    :raises ValueError: ``window_s`` is not > 0.
    """

    __slots__ = ("_bucket_s", "_calls", "_failures", "_index", "calls", "failures")

    def __init__(self, window_s: float) -> None:
        if not window_s > 0 or math.isinf(window_s):
            raise ValueError("window_s must be a positive number of seconds")
        self._bucket_s = window_s / BUCKETS
        self._calls = [0] * BUCKETS
        self._failures = [0] * BUCKETS
        self._index: int | None = None  # the absolute bucket number last written
        self.calls = 0
        """Calls recorded in the window (as of the last :meth:`record` or :meth:`advance`)."""
        self.failures = 0
        """Failures among :attr:`calls`."""

    def advance(self, now: float) -> None:
        """Drop the buckets that fell out of the window by ``now`` (at most
        :data:`BUCKETS` steps); :attr:`calls` and :attr:`failures` are then current."""
        index = int(now // self._bucket_s)
        last = self._index
        if last is None or index - last >= BUCKETS:
            if self.calls:
                self.reset()
            self._index = index
            return
        calls, failures = self._calls, self._failures
        while last < index:  # each bucket passed since the last write starts empty
            last += 1
            slot = last % BUCKETS
            self.calls -= calls[slot]
            self.failures -= failures[slot]
            calls[slot] = failures[slot] = 0
        self._index = index

    def record(self, failed: bool, now: float) -> None:
        """Count one candidate call (a success, or a failure when ``failed``) at ``now``.

        ``now`` never goes back (a monotonic clock); a call recorded at an earlier
        ``now`` than the last counts in the current bucket.
        """
        self.advance(now)
        slot = (self._index or 0) % BUCKETS
        self._calls[slot] += 1
        self.calls += 1
        if failed:
            self._failures[slot] += 1
            self.failures += 1

    def opens(self, threshold: float, minimum_calls: int) -> bool:
        """Whether the window, as last advanced, opens the breaker: at least
        ``minimum_calls`` calls, and a failure share of at least ``threshold`` (0 to 1)."""
        calls = self.calls
        return calls >= minimum_calls and self.failures / calls >= threshold

    def reset(self) -> None:
        """Empty the window (the breaker closed: contract, "the window starts empty
        again on every close")."""
        for slot in range(BUCKETS):
            self._calls[slot] = self._failures[slot] = 0
        self.calls = self.failures = 0
        self._index = None

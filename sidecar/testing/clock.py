"""A clock that moves only when told to: the test double of :class:`sidecar.clock.Clock`."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from sidecar.clock import TimerHandle

__all__ = ["FakeClock"]


class _FakeTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that moves only when told to, for tests.

    ``advance(seconds)`` moves time forward and runs every due timer, in order,
    synchronously. ``sleep(seconds)`` advances time by ``seconds`` at once
    (recording the request in ``sleeps``) and yields to the loop once, so code
    that waits (retry backoff, ``Retry-After``) runs instantly and tests can
    assert on how long it asked to wait.

    ``wall(t)`` maps monotonic ``t`` to ``epoch + t`` (``epoch`` defaults to
    2026-01-01T00:00:00Z).
    """

    def __init__(self, start: float = 1000.0, epoch: float = 1767225600.0) -> None:
        self.t = start
        self.epoch = epoch
        self.sleeps: list[float] = []
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    def wall(self, t: float) -> float:
        return self.epoch + t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if seconds > 0:
            self.advance(seconds)
        await asyncio.sleep(0)

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        timer = _FakeTimer(when, callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def pending(self) -> list[float]:
        """The times (monotonic seconds) of the timers not yet fired nor cancelled, soonest
        first: a test waits until the code under test has armed one (no sleep)."""
        return sorted(when for when, _, timer in self._timers if not timer.cancelled)

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and fire due timers (synchronously)."""
        target = self.t + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            self.t = max(self.t, when)
            if not timer.cancelled:
                timer.callback()
        self.t = target

"""Injected time: the only place the sidecar reads a clock or sleeps.

Everything that decides on time (breaker cooldowns, retry waits, the open ->
half-open timer) takes a :class:`Clock`, so tests drive time with
:class:`FakeClock` instead of waiting on the wall clock.

Units: seconds (float), on a monotonic scale. ``wall(t)`` converts a monotonic
instant to Unix seconds for display (``/status`` RFC 3339 fields, logs).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    """A scheduled callback that can be cancelled."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic time, sleeping and timers.

    ``now()`` is monotonic seconds; ``wall(t)`` is the Unix time of monotonic
    instant ``t``; ``sleep(s)`` waits ``s`` seconds; ``call_at(t, cb)`` runs
    ``cb()`` once on the event loop when ``now() >= t``.
    """

    def now(self) -> float: ...

    def wall(self, t: float) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle: ...


class LoopClock:
    """The real clock: the running event loop's monotonic time.

    Must be used from inside a running event loop (``now`` and ``call_at`` use
    :func:`asyncio.get_running_loop`).
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def now(self) -> float:
        return self._get_loop().time()

    def wall(self, t: float) -> float:
        return time.time() - self._get_loop().time() + t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        return self._get_loop().call_at(when, callback)


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

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and fire due timers (synchronously)."""
        target = self.t + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            self.t = max(self.t, when)
            if not timer.cancelled:
                timer.callback()
        self.t = target

"""Injected time: the only place the sidecar reads a clock or sleeps.

Everything that decides on time (breaker cooldowns, retry waits, the open ->
half-open timer, and every deadline: request, first byte, idle, body, request
head) takes a :class:`Clock`, so tests drive time with
:class:`sidecar.testing.FakeClock` instead of waiting on the wall clock.

Units: seconds (float), on a monotonic scale. ``wall(t)`` converts a monotonic
instant to Unix seconds for display (``/status`` RFC 3339 fields, logs).
"""

from __future__ import annotations

import asyncio
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
    :func:`asyncio.get_running_loop`). ``now`` is read about a dozen times per
    proxied request: on asyncio's own loop, whose ``time()`` is
    :func:`time.monotonic`, it calls that directly (one call instead of four);
    on another loop (uvloop) it calls the loop's ``time``.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._time: Callable[[], float] = self._bind_time

    def _bind_time(self) -> float:
        loop = self._get_loop()
        asyncio_time = type(loop).time is asyncio.BaseEventLoop.time
        self._time = time.monotonic if asyncio_time else loop.time
        return self._time()

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def now(self) -> float:
        return self._time()

    def wall(self, t: float) -> float:
        return time.time() - self._time() + t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        return self._get_loop().call_at(when, callback)

"""What the demo prints: plain lines, colour only on a terminal, and the breaker story.

:class:`Screen` writes one line at a time (no cursor tricks, so it reads the
same in a terminal, a pipe or a CI log). :class:`Story` turns the sidecar's own
breaker log events (``breaker_opened`` / ``breaker_half_open`` /
``breaker_closed``) and the requests reaching the primary into event lines.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TextIO

import aiohttp

__all__ = [
    "BreakerLogTap",
    "Screen",
    "Story",
    "current_status",
    "fmt_ms",
    "seconds_until",
    "state_text",
]

_CODES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}


class Screen:
    """Line-oriented output on ``stream``; ANSI colour only when it is a TTY.

    Colour is also off with ``NO_COLOR`` set or ``TERM=dumb``. A closed pipe
    (``sidecar demo | head``) ends the output quietly; the demo goes on.
    """

    def __init__(self, stream: TextIO | None = None, color: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        if color is None:
            isatty = getattr(self.stream, "isatty", None)
            color = bool(isatty and isatty())
            color = color and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
        self.color = color
        self.closed = False

    def paint(self, text: str, *styles: str) -> str:
        """``text`` in the given styles (``bold``, ``red``, ...), or plain without colour."""
        if not self.color or not styles:
            return text
        codes = ";".join(_CODES[s] for s in styles)
        return f"\x1b[{codes}m{text}\x1b[0m"

    def line(self, text: str = "") -> None:
        """Write one line and flush it."""
        if self.closed:
            return
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except BrokenPipeError:
            self.closed = True
            self._silence()

    def _silence(self) -> None:
        # Point stdout at /dev/null so the interpreter's final flush does not fail too.
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


def fmt_ms(ms: float | None) -> str:
    """``"46 ms"``, ``"1.2 s"``; ``"-"`` for None."""
    if ms is None:
        return "-"
    if ms >= 1000:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.0f} ms"


def state_text(screen: Screen, state: str, retry_in: float | None, width: int) -> str:
    """The primary's breaker state as a table cell, padded to ``width`` then coloured."""
    if state == "open":
        text = "OPEN" if retry_in is None else f"OPEN (probe in {max(1, math.ceil(retry_in))}s)"
        return screen.paint(f"{text:<{width}}", "bold", "red")
    if state == "half_open":
        return screen.paint(f"{'HALF-OPEN (probe)':<{width}}", "bold", "yellow")
    return screen.paint(f"{state:<{width}}", "green")


def seconds_until(rfc3339: object) -> float | None:
    """Seconds from now until an RFC 3339 time (None if it is not one)."""
    if not isinstance(rfc3339, str):
        return None
    try:
        return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp() - time.time()
    except ValueError:
        return None


class Story:
    """Narrates the primary's breaker: transitions, probes and phase changes, as they happen.

    ``now()`` gives seconds since the traffic started (for the ``>> 7.9s`` stamps).
    """

    def __init__(self, screen: Screen, now: Callable[[], float], upstream: str = "primary") -> None:
        self.screen = screen
        self.now = now
        self.upstream = upstream
        self.state = "closed"
        self.openings = 0
        self.probes_sent = 0
        self.probes_failed = 0
        self.probes_ok = 0
        self.transitions = 0
        """Breaker events narrated so far (the table re-reads a state older than one)."""
        self._probe_announced = False

    def event(self, text: str, *styles: str, marker: str = ">>") -> None:
        """One ``>> 7.9s  text`` line (``--`` for what the fake provider does)."""
        stamp = f"{self.now():.1f}s"
        marker = self.screen.paint(marker, "bold", "cyan")
        body = self.screen.paint(text, *styles) if styles else text
        self.screen.line(f"  {marker} {stamp:<6} {body}")

    def more(self, text: str) -> None:
        """A continuation line under an event."""
        self.screen.line(f"  {'':<9} {text}")

    # -- the sidecar's breaker log events -------------------------------------------

    def transition(self, event: str, fields: dict[str, Any]) -> None:
        """A breaker log event of the sidecar (called from :class:`BreakerLogTap`)."""
        if fields.get("upstream") != self.upstream:
            return
        self.transitions += 1
        before, last = self.state, fields.get("last_failure") or "failure"
        wait = seconds_until(fields.get("retry_at"))
        wait_text = "" if wait is None else f" for {max(wait, 0):.1f} s"
        if event == "breaker_opened":
            self.state = "open"
            self.openings += 1
            if before == "half_open":
                self.probes_failed += 1
                self.event(f"probe failed ({last}): breaker OPEN again{wait_text}", "bold", "red")
            else:
                n = fields.get("consecutive_failures")
                self.event(
                    f"breaker OPENED on {self.upstream} after {n} failed calls ({last}):",
                    "bold",
                    "red",
                )
                self.more(f"requests skip {self.upstream} and go straight to fallback{wait_text}")
        elif event == "breaker_half_open":
            self.state = "half_open"
            self._probe_announced = False
            self.event(
                f"cooldown over: breaker HALF-OPEN, next request probes {self.upstream}",
                "yellow",
            )
        elif event == "breaker_closed":
            self.state = "closed"
            if before == "half_open":
                self.probes_ok += 1
            self.event(
                f"probe succeeded: breaker CLOSED, {self.upstream} is back in service",
                "bold",
                "green",
            )

    def primary_request(self) -> None:
        """A request reached the primary's fake (watched on its request counter)."""
        if self.state == "half_open" and not self._probe_announced:
            self._probe_announced = True
            self.probes_sent += 1
            self.event(f"probe sent to {self.upstream} (other requests still go to fallback)")


async def current_status(
    session: aiohttp.ClientSession, admin_url: str, story: Story, tries: int = 3
) -> dict[str, Any]:
    """``GET /status?all=1``, as fresh as the event lines already printed.

    The admin handler takes its snapshot, then the answer travels back; a breaker
    event logged meanwhile is printed (``>>``) before the row that would show the
    older state. So when ``story`` narrated a transition during the fetch, fetch
    again (up to ``tries`` times). ``{}`` when the admin port does not answer.
    """
    status: dict[str, Any] = {}
    for _ in range(tries):
        seen = story.transitions
        try:
            async with session.get(admin_url + "/status?all=1") as resp:
                status = await resp.json()
        except (aiohttp.ClientError, ValueError):
            status = {}
        if story.transitions == seen:
            break
    return status


_BREAKER_EVENTS = frozenset({"breaker_opened", "breaker_half_open", "breaker_closed"})


class BreakerLogTap(logging.Handler):
    """Receives the ``sidecar`` logger's records instead of the screen; forwards breaker
    transitions to a :class:`Story`. Everything else the sidecar logs is dropped."""

    def __init__(self, story: Story) -> None:
        super().__init__(logging.INFO)
        self.story = story

    def emit(self, record: logging.LogRecord) -> None:
        event = record.msg if isinstance(record.msg, str) else ""
        if event not in _BREAKER_EVENTS:
            return
        fields = getattr(record, "fields", None)
        self.story.transition(event, fields if isinstance(fields, dict) else {})

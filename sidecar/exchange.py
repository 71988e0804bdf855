"""One proxied request's state: what happened so far, and its one timer.

An :class:`Exchange` is made when a request enters the proxy handler and lives
until the handler ends. It holds:

* the facts the handler's end reports (route, upstream relayed, attempts,
  fallbacks, the cause of the last failed attempt, first byte, status, the
  sidecar's own error code, how the relay ended): metrics and the access log line
  (:mod:`sidecar.access_log`);
* the request's deadlines, all read from the injected :class:`~sidecar.clock.Clock`
  (contract, "Configuration": ``request_timeout_ms``, ``first_byte_timeout_ms``,
  ``idle_timeout_ms``, and ``client_read_timeout_ms`` for the body), served by
  **one timer, re-armed lazily**: moving a deadline later only stores a float; the
  timer, when it fires early, re-arms itself at the deadline now due. When a
  deadline passes, the timer cancels the handler's task and :meth:`expired` tells
  the handler which deadline it was (as :func:`asyncio.timeout` does, without a
  context manager per deadline and a reschedule per streamed chunk).

Deadlines (monotonic seconds, ``inf`` = none): ``request_at`` bounds everything up
to the commit point; ``phase_at`` is the current phase's own deadline
(:data:`FIRST_BYTE`, :data:`IDLE` or :data:`BODY`). While the request waits for a
pooled upstream connection (``max_connections`` busy), the first-byte deadline is
paused and restarts when a connection is free (:mod:`sidecar.wire.pool`): that wait is
the sidecar's own, not the upstream's.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from sidecar.answers import ErrorAnswer
from sidecar.breakers.types import Target
from sidecar.clock import Clock, TimerHandle
from sidecar.outcome import UpstreamError
from sidecar.usage import Usage

if TYPE_CHECKING:
    from sidecar.tracing.spans import RequestTrace

CLIENT_CLOSED_REQUEST = 499
"""``status`` of a request whose client went away before its answer ended (nginx's 499)."""

REQUEST = "request"
"""``request_timeout_ms`` ran out before the commit point."""
FIRST_BYTE = "first_byte"
"""``first_byte_timeout_ms`` ran out: no first body chunk since the attempt was sent."""
IDLE = "idle"
"""``idle_timeout_ms`` ran out: no chunk for that long, after the commit point (the
relay), or between the chunks of a 2xx JSON answer read whole before it
(:mod:`sidecar.commit_input`: there it is that attempt's timeout)."""
BODY = "body"
"""``client_read_timeout_ms`` ran out while the client was sending its body."""

_INF = math.inf


class HedgeTimer(Protocol):
    """What :meth:`Exchange.arm_hedge` waits on (:class:`sidecar.hedge.Race`)."""

    at: float
    """When the hedge is due (monotonic seconds, the injected clock's)."""

    def fire(self) -> None:
        """The hedge's time came (called from the Exchange's timer)."""


class Exchange:
    """The state of one request in the proxy handler (see the module docstring).

    :param clock: the injected clock; every deadline is read from it.
    :param task: the handler's task (cancelled when a deadline passes).
    :param started: ``clock.now()`` when the request arrived.
    """

    __slots__ = (
        "_armed_at",
        "_handle",
        "abort_reason",
        "aborted",
        "attempts",
        "client_left",
        "clock",
        "error",
        "expired_phase",
        "fallbacks",
        "first_byte_s",
        "hedge",
        "hedge_timer",
        "last_error",
        "output_at",
        "phase",
        "phase_at",
        "phase_s",
        "queued",
        "raw_head",
        "request_at",
        "reused",
        "route",
        "started",
        "status",
        "target",
        "task",
        "trace",
        "upstream",
        "upstream_error",
        "usage",
    )

    def __init__(self, clock: Clock, task: asyncio.Task[object], started: float) -> None:
        self.clock = clock
        self.task = task
        self.started = started
        self.route = ""
        """The chosen route's name (metric label); "" until a route is chosen."""
        self.upstream: str | None = None
        """The upstream whose answer is relayed."""
        self.attempts = 0
        """Every upstream attempt made for this request (``x-sidecar-attempts``)."""
        self.fallbacks = 0
        self.upstream_error: str | None = None
        """The cause of the last failed attempt (the access log's ``upstream_error``:
        :mod:`sidecar.causes`), or None while no attempt failed. Set on failures only."""
        self.last_error: UpstreamError | None = None
        """The current candidate call's last attempt's transport failure (None after an
        HTTP answer): what a ``request_timeout_ms`` that runs out meanwhile answers
        (:func:`~sidecar.answers.deadline_failure`)."""
        self.first_byte_s: float | None = None
        """Seconds from :attr:`started` to the relayed answer's first body chunk (the
        commit point: for a stream, its first output event); None without one."""
        self.status = 500
        self.error: str | None = None
        """The sidecar's own error ``code`` when it answered itself."""
        self.aborted = False
        """True when the relay cut the client mid-answer (upstream failure or idle timeout)."""
        self.abort_reason = ""
        """Why the relay cut it: ``upstream_cut`` or ``idle_timeout``
        (``sidecar_stream_aborts_total``)."""
        self.target: Target | None = None
        """The breaker target whose answer is relayed (metric labels)."""
        self.usage: Usage | None = None
        """The relayed answer's token usage, filled as its body is relayed; None when
        it is not read (:mod:`sidecar.usage`)."""
        self.output_at: float | None = None
        """Set by the commit point's reader when a JSON body took more than one chunk:
        when its first chunk came (its first output is timed there); else None."""
        self.client_left = False
        """True when the client went away while its answer was being written."""
        self.hedge_timer: HedgeTimer | None = None
        """A hedge waiting for its time (:meth:`arm_hedge`), served by this Exchange's one
        timer; None when none is due."""
        self.hedge: str | None = None
        """A route with ``hedge_after_ms``: ``won``, ``lost`` or ``not_sent`` once its
        hedge was due, else "" (:mod:`sidecar.hedge`); None on other routes (the
        access log's ``hedge`` field appears only on a hedging route's lines)."""
        self.request_at = _INF
        self.phase: str | None = None
        self.phase_at = _INF
        self.phase_s = 0.0
        self.queued = False
        """True while the current attempt waits for a pooled connection (nothing sent yet)."""
        self.reused = False
        """True when the current attempt went out on a pooled keep-alive connection."""
        self.raw_head = False
        """The client's head holds octets outside ASCII: the upstream request's head is
        written with them as they came (:class:`sidecar.wire.UpstreamRequest`)."""
        self.expired_phase: str | None = None
        self.trace: RequestTrace | None = None
        """This request's spans (``[tracing]``, :mod:`sidecar.tracing`); None when
        tracing is off or the request is not sampled."""
        self._handle: TimerHandle | None = None
        self._armed_at = _INF

    def answered(self, resp: web.StreamResponse) -> None:
        """The handler answers ``resp``: its status (:data:`CLIENT_CLOSED_REQUEST` when the
        client left while it was written) and, for the sidecar's own answer, its code."""
        self.status = CLIENT_CLOSED_REQUEST if self.client_left else resp.status
        if type(resp) is ErrorAnswer:
            self.error = resp.code

    def left(self) -> None:
        """The handler was cancelled: the client went away (or a drain cut it) before
        the answer ended."""
        self.client_left = True
        self.status = CLIENT_CLOSED_REQUEST

    # -- deadlines -------------------------------------------------------------

    def start_request(self, seconds: float) -> None:
        """Bound everything up to the commit point by ``seconds`` from now.

        Only stored: the timer is armed by the first phase that starts (every await
        before the commit point is inside one), at the earlier of the two deadlines.
        """
        self.request_at = self.clock.now() + seconds

    def bound_request(self, at: float) -> None:
        """Bring the request deadline forward to ``at`` (monotonic seconds) when that is
        sooner: the client's own deadline (:mod:`sidecar.client_deadline`). Called after
        :meth:`start_request`, before any phase starts; like it, only stored."""
        if at < self.request_at:
            self.request_at = at

    def start(self, phase: str, seconds: float) -> None:
        """Start ``phase`` (:data:`FIRST_BYTE`, :data:`IDLE`, :data:`BODY`), due in ``seconds``."""
        self.phase = phase
        self.phase_s = seconds
        at = self.phase_at = self.clock.now() + seconds
        due = at if at < self.request_at else self.request_at
        if due < self._armed_at:
            self._arm(due)

    def touch(self) -> None:
        """The phase made progress (a chunk relayed): its deadline starts again from now.

        Stores one float: the armed timer re-arms itself when it fires early.
        """
        self.phase_at = self.clock.now() + self.phase_s

    def stop_phase(self) -> None:
        """The current phase ended in time (the armed timer goes quiet or re-arms lazily)."""
        self.phase = None
        self.phase_at = _INF

    def end_request(self) -> None:
        """The commit point: ``request_timeout_ms`` no longer applies."""
        self.request_at = _INF

    def time_left(self) -> float:
        """Seconds until the request deadline (``inf`` when none)."""
        return self.request_at - self.clock.now()

    def wait_for_connection(self, waiting: bool) -> None:
        """Called by :class:`~sidecar.wire.pool.PoolConnector` around a wait for a pooled
        connection.

        The first-byte deadline pauses while waiting and restarts from when a
        connection is free (the request deadline still bounds the wait).
        """
        self.queued = waiting
        if not waiting and self.phase is FIRST_BYTE:
            self.phase_at = self.clock.now() + self.phase_s

    def expired(self) -> str | None:
        """After a :class:`asyncio.CancelledError`: the deadline that caused it, or None.

        None means the cancellation came from elsewhere (the client went away,
        shutdown) and must propagate. A deadline's cancellation is consumed here
        (``Task.uncancel``), so the handler goes on to answer.
        """
        phase = self.expired_phase
        if phase is None:
            return None
        self.expired_phase = None
        if self.task.uncancel() > 0:
            return None  # cancelled from elsewhere as well
        return phase

    def close(self) -> None:
        """Stop the timer (the handler ended)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_at = _INF

    def _arm(self, at: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = at
        self._handle = self.clock.call_at(at, self._fire)

    def arm_hedge(self, timer: HedgeTimer) -> None:
        """Call ``timer.fire()`` at ``timer.at`` (monotonic seconds) unless
        :meth:`disarm_hedge` comes first: a hedge's time (:mod:`sidecar.hedge`), served by
        the Exchange's one timer (armed sooner when needed), so a hedging route's request
        that answers in time costs no timer of its own."""
        self.hedge_timer = timer
        if timer.at < self._armed_at:
            self._arm(timer.at)

    def disarm_hedge(self) -> None:
        """The hedge's time will not come (the call it raced ended): only stored; the
        armed timer, when it fires early, re-arms itself at the deadline then due."""
        self.hedge_timer = None

    def _fire(self) -> None:
        self._handle = None
        self._armed_at = _INF
        now = self.clock.now()
        hedge = self.hedge_timer
        if hedge is not None and hedge.at <= now:
            self.hedge_timer = None
            hedge.fire()  # starts the hedge, or counts it not sent; never raises
        phase_at = _INF if self.queued else self.phase_at
        if self.request_at <= now:
            self.expired_phase = REQUEST
        elif phase_at <= now:
            self.expired_phase = self.phase
        else:
            due = min(self.request_at, phase_at)
            hedge = self.hedge_timer
            if hedge is not None and hedge.at < due:
                due = hedge.at
            if due < _INF:
                self._arm(due)
            return
        self.task.cancel()

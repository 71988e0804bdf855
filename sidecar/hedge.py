"""Hedged first token: the race of one request's candidate with the next one.

Contract, "Bounding the load that failures add" (route ``hedge_after_ms`` > 0): when
the candidate being tried has not reached its commit point ``hedge_after_ms`` after
it was sent, the same request is also sent to the candidate that would be tried next
(never one whose breaker refuses it), within that upstream's retry budget, at most
once per request. The first of the two to reach its commit point is relayed; the
other is cancelled (its connection closed, outcome ``cancelled``, neutral for its
breaker). If one fails before its commit point, the other goes on alone.

This module holds the race's state and mechanics; the proxy (:mod:`sidecar.proxy`,
``Proxy._hedged``) holds the fallback loop of a hedging route and the calls. Who runs
what:

* the **primary** call (the candidate being tried) runs in the request handler's task,
  on the request's :class:`~sidecar.exchange.Exchange`, exactly as without hedging;
* a **timer** on the injected clock (:meth:`Race.arm`, ``hedge_after_ms`` after the
  call started) picks the hedge's candidate (:func:`search`, synchronously, from the
  same order iterator the fallback loop reads) and starts the **hedge** call in a task
  of its own (:meth:`Race.launch`), on a child Exchange (:func:`child_exchange`: its
  own first-byte and idle deadlines and timer, the request deadline shared);
* the hedge reaching its commit point while the primary runs cancels the handler's
  task (:meth:`Race.ended`): the primary call counts its attempt ``cancelled``,
  releases its permit and closes its connection as for any cancellation, and the
  handler, seeing :attr:`Race.won`, takes back that cancellation and relays the
  hedge's answer;
* the primary reaching its commit point first cancels the hedge's task and waits for
  it to end (:meth:`Race.stop`) before the answer is relayed, so the hedge's attempts
  are in ``x-sidecar-attempts``;
* a racer that fails leaves the other alone: a failed hedge's result waits in
  :attr:`Race.result`; a failed primary lets the fallback loop go on, and the loop
  reaches the hedged candidate and waits for it (:meth:`Race.join`) instead of calling
  it again, before it asks again a candidate the hedge's search passed over as a
  half-open probe (so no probe is sent beside the hedge going on alone);
* the client leaving or the request deadline (the handler's task cancelled) stops
  the hedge and waits for it before the cancellation goes on (nothing left running).

The hedge's child Exchange shares the request deadline (``request_at``): a retry of
the hedge is not started past it, and its own timer cuts it there; the handler's
timer cuts the handler at the same instant, and the handler stops the hedge.

Everything here runs on the event loop's thread; no lock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Generic, TypeVar

from sidecar.breakers.types import Permit
from sidecar.clock import Clock
from sidecar.exchange import Exchange
from sidecar.outcome import UpstreamError, UpstreamTimeout
from sidecar.retry_budget import RetryBudget
from sidecar.routes import Candidate

__all__ = [
    "HEDGED",
    "LOST",
    "NOT_SENT",
    "WON",
    "Race",
    "child_exchange",
    "search",
]

WON = "won"
"""``sidecar_hedges_total{result}``: the hedge's answer was relayed."""
LOST = "lost"
"""The hedge was sent and its answer was not relayed (the primary's was, or it failed)."""
NOT_SENT = "not_sent"
"""The hedge was due and not sent: no candidate left to send it to, or no budget."""

HEDGED = "hedged"
"""The mark of the hedged candidate in :attr:`Race.pending`: the fallback loop joins
the running hedge there (:meth:`Race.join`) instead of calling the candidate."""

A = TypeVar("A")
"""A committed or failing answer of a candidate call (the proxy's ``Answer``)."""

Admit = Callable[[Candidate], tuple[Permit | None, str]]
"""Ask a candidate's breakers: (its permit, "") or (None, why it is skipped:
``circuit_open`` or ``ramp``)."""


def search(
    order: Iterator[Candidate],
    admit: Admit,
    fit: Callable[[Permit], bool],
    release: Callable[[Permit], None],
) -> tuple[tuple[Candidate, Permit] | None, list[tuple[Candidate, str | None]]]:
    """The hedge's candidate: the next one in ``order`` (the fallback loop's iterator)
    whose breaker admits it with a permit ``fit`` for a hedge.

    :param admit: asks a candidate's breakers (:data:`Admit`).
    :param fit: whether a permit may carry a hedge (the proxy: not a half-open probe
        and no fleet lease needed: a probe is an answer the breaker waits for, which a
        hedge, cancelled whenever it loses, would not give).
    :param release: settles a permit not used (neutral).
    :returns: the candidate and its permit (None when ``order`` ran out), and the
        candidates passed over on the way, in order, for the fallback loop to take
        before it reads ``order`` again: ``(candidate, why)`` for one its breaker
        refused (skipped there with that reason, not asked again), ``(candidate,
        None)`` for one admitted with a permit unfit for a hedge (released here, asked
        again there).
    """
    passed: list[tuple[Candidate, str | None]] = []
    for cand in order:
        permit, why = admit(cand)
        if permit is None:
            passed.append((cand, why))
        elif not fit(permit):
            release(permit)
            passed.append((cand, None))
        else:
            return (cand, permit), passed
    return None, passed


def child_exchange(ex: Exchange) -> Exchange:
    """A child of ``ex`` for the hedge call: the same clock, start and request deadline,
    route, head flag and request trace; its own phases and timer. Its :attr:`~Exchange.task` is set
    by :meth:`Race.launch` (until then it is the handler's, never used)."""
    child = Exchange(ex.clock, ex.task, ex.started)
    child.route = ex.route
    child.request_at = ex.request_at
    child.raw_head = ex.raw_head
    child.trace = ex.trace  # [tracing]: the hedge's attempts are spans of the request
    return child


class Race(Generic[A]):
    """The hedge of one request (see the module docstring): at most one per request.

    :param after_s: the route's ``hedge_after_ms`` in seconds (> 0).
    :param order: the fallback loop's candidate iterator (shared with it).
    :param ex: the request's Exchange; its :attr:`~Exchange.task` is the handler's
        task (cancelled when the hedge wins).
    """

    __slots__ = (
        "abandoned",
        "after_s",
        "at",
        "budget",
        "child",
        "due",
        "ex",
        "fire_cb",
        "hedged",
        "order",
        "outcome",
        "pending",
        "permit",
        "primary_running",
        "result",
        "started",
        "task",
        "won",
    )

    def __init__(self, after_s: float, order: Iterator[Candidate], ex: Exchange) -> None:
        self.after_s = after_s
        self.order = order
        self.ex = ex
        self.pending: deque[tuple[Candidate, str | None]] = deque()
        """Candidates the hedge's search took from :attr:`order`, for the fallback loop
        first: ``why`` a skip reason, None (ask its breaker), or :data:`HEDGED`."""
        self.due = True
        """No hedge decided yet (the timer may still be armed once more)."""
        self.at = 0.0
        """When the armed hedge is due (monotonic seconds; :meth:`arm`)."""
        self.fire_cb: Callable[[], None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.child: Exchange | None = None
        self.hedged: Candidate | None = None
        """The candidate the hedge was sent to."""
        self.permit: Permit | None = None
        self.budget: RetryBudget | None = None
        self.result: tuple[A | UpstreamError, str | None] | None = None
        """The hedge call's end as ``Proxy._call`` returns it, until taken (:meth:`take`)."""
        self.won = False
        """The hedge reached its commit point while the primary was running."""
        self.primary_running = False
        """The handler's task is inside the primary call (set by the proxy)."""
        self.started = False
        self.abandoned = False
        self.outcome: str | None = None
        """:data:`WON`, :data:`LOST` or :data:`NOT_SENT` once decided; None: no hedge was due."""

    # -- the fallback loop's side ------------------------------------------------------

    def next(self) -> tuple[Candidate, str | None] | None:
        """The next candidate for the fallback loop: :attr:`pending` first, then
        :attr:`order`; None when both ran out."""
        if self.pending:
            return self.pending.popleft()
        cand = next(self.order, None)
        return None if cand is None else (cand, None)

    def arm(self, clock: Clock, fire: Callable[[], None]) -> None:
        """Call ``fire`` ``after_s`` from now on ``clock`` (the primary call starts),
        served by the request Exchange's one timer (:meth:`Exchange.arm_hedge`: no timer
        of its own, so a request answered in time pays for none)."""
        self.at = clock.now() + self.after_s
        self.fire_cb = fire
        self.ex.arm_hedge(self)

    def fire(self) -> None:
        """The Exchange's timer: the hedge's time came
        (:class:`~sidecar.exchange.HedgeTimer`); the one hedge of this request is being
        decided (no more is due)."""
        self.due = False
        fire, self.fire_cb = self.fire_cb, None
        if fire is not None:
            fire()

    def disarm(self) -> None:
        """The primary call ended: its hedge, if not yet due, never will be."""
        if self.fire_cb is not None:
            self.fire_cb = None
            self.ex.disarm_hedge()

    def not_sent(self) -> None:
        """The hedge was due and is not sent."""
        self.outcome = NOT_SENT

    def launch(
        self,
        cand: Candidate,
        permit: Permit,
        budget: RetryBudget,
        child: Exchange,
        call: Callable[[], Coroutine[Any, Any, tuple[A | UpstreamError, str | None]]],
        release: Callable[[Permit], None],
    ) -> None:
        """Start the hedge: ``call()`` (the candidate call on ``child``) in a task of its
        own. ``budget`` was taken for it (given back when it ends); ``release`` settles
        ``permit`` if the hedge is stopped before its call began."""
        self.hedged, self.permit, self.budget, self.child = cand, permit, budget, child
        self.outcome = LOST  # until its answer is relayed
        # The loop joins the hedge before it asks again a candidate the search passed
        # over as a probe (why None): a primary that fails leaves the hedge to go on
        # alone (contract), with no probe sent beside it; refused ones are only counted.
        passed = list(self.pending)
        self.pending.clear()
        self.pending.extend(p for p in passed if p[1] is not None)
        self.pending.append((cand, HEDGED))
        self.pending.extend(p for p in passed if p[1] is None)
        task = asyncio.get_running_loop().create_task(self._run(call, release, child))
        child.task = task  # the child's deadlines cancel the hedge
        self.task = task

    async def _run(
        self,
        call: Callable[[], Coroutine[Any, Any, tuple[A | UpstreamError, str | None]]],
        release: Callable[[Permit], None],
        child: Exchange,
    ) -> None:
        """The hedge task: the call, then its counts merged into the request's."""
        self.started = True
        budget = self.budget
        assert budget is not None
        if self.abandoned:  # stopped before it began: nothing was sent
            assert self.permit is not None
            release(self.permit)
            budget.give_back()
            return
        try:
            result = await call()
        finally:
            child.close()
            budget.give_back()
            ex = self.ex  # the request's counts: both racers' attempts, the last cause
            ex.attempts += child.attempts
            if child.upstream_error is not None:
                ex.upstream_error = child.upstream_error
        self.ended(result)

    def ended(self, result: tuple[A | UpstreamError, str | None]) -> None:
        """The hedge call returned ``result``; one that commits while the primary runs
        wins: the handler's task is cancelled (the proxy takes that cancellation back)."""
        self.result = result
        if result[1] is None and self.primary_running:
            self.won = True
            self.ex.task.cancel()

    async def stop(self) -> None:
        """Cancel the hedge if it runs (its connection is closed, its permit released)
        and wait for its task to end; nothing when it was never sent or has ended."""
        task = self.task
        if task is None or task.done():
            return
        if self.started:
            task.cancel()
        else:
            self.abandoned = True  # it ends at its first step, with nothing sent
        await asyncio.wait((task,))

    async def join(self) -> tuple[A | UpstreamError, str | None]:
        """The hedge's result once it ends (the fallback loop reached it): it goes on
        alone. A hedge cut by the request deadline (its own timer) is a timeout."""
        task = self.task
        assert task is not None
        if not task.done():
            await asyncio.wait((task,))
        result = self.take()
        if result is None:
            return UpstreamTimeout("request_timeout_ms ran out"), "failure"
        return result

    def take(self) -> tuple[A | UpstreamError, str | None] | None:
        """The hedge's result, handed over once (None: none, or taken)."""
        result, self.result = self.result, None
        return result

"""The proxy handler: what happens to one request, top to bottom, on one page.

::

    admit        in-flight cap (503 overloaded); an HTTP/1 request line (505), a request
                 target and Host fit to relay (400), a known transfer coding (501)
    body         read up to max_request_body_bytes (413), within client_read_timeout_ms
    route        routes.resolve(path, headers, body)              404 / 400
                 (a path with dot segments: the same route for every reading, or 400)
    _candidates  for candidate in the route's order:              the fallback loop
                     (a list in order; with tiers, _members: a session's member,
                      then each tier's members as sidecar.choice picks them)
                     permit = breakers.admit(target)              None -> skip it
                                                                  (open, full, ramping)
                     _call(candidate, permit)                     commit, or a fallback
    _call        for each attempt (1 + max_retries):              the retry loop
                     response = await send(...)                   status and headers
                     first = await read_commit_input(response)   the commit point's input
                     _judged: judge(status, first, said, ...)   commit, retry or move on
                     a retry: the deadline, the breaker, a client's   no retry: move on
                     retry (x-stainless-retry-count), the budget
                 _settle: breakers.record(permit, verdict)        once per candidate call
    _hedged      a route with hedge_after_ms: the fallback loop    sidecar.hedge
                 with a race: the candidate being called, no commit point after
                 hedge_after_ms -> the next one too (its own task); first to commit wins
    relay        status, headers, held bytes, then the rest       no retry, no replay
    end          metrics and the access log line (sidecar.access_log) from the Exchange

With ``[tracing]`` (:mod:`sidecar.tracing`) a sampled request's ``ex.trace`` gets a few
calls, each behind ``if ... is not None``: its SERVER span at the start and its end in
:meth:`Proxy.handle`, a skipped candidate's event in :meth:`Proxy._candidates`, each
attempt's CLIENT span at its send and its end in :meth:`Proxy._call` (whose ``reason``
parameter says why the call is made), the commit point in :meth:`Proxy._serve`.

Each rule has one home: the retry loop and its breaker record in :meth:`Proxy._call`,
the fallback loop and every fallback's count in :meth:`Proxy._candidates` (for a route
with ``hedge_after_ms``, :meth:`Proxy._hedged`; the race's mechanics in
:mod:`sidecar.hedge`), the request deadline's answer in :meth:`Proxy._serve` (its
cancellation passes through both loops, which only let go of what they hold: a held
answer, a running hedge; the attempt it cuts is counted where it was made).

**The commit point**: the first response body chunk, or for a 2xx event stream its
first event with output, or a 2xx JSON answer read whole; everything read before it
is read by :mod:`sidecar.commit_input` (including the first chunk of a retried status
that ends up relayed). Until then the client has seen nothing, and a failure may be
retried or fall back (:func:`sidecar.judge.judge` decides); after it
(:mod:`sidecar.relay`) a failure aborts the client connection.

Every deadline is one float on the :class:`~sidecar.exchange.Exchange`, served by one
timer on the injected clock; the request's is ``request_timeout_ms``, or sooner the
client's own announced timeout less its margin (:mod:`sidecar.client_deadline`). A
permit is always settled: by ``record`` with the verdict, or by ``release`` in a
``finally``. Failures become answers in :mod:`sidecar.answers`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

from aiohttp import ClientResponse, HttpVersion11, hdrs, web
from multidict import CIMultiDictProxy

from sidecar import access_log
from sidecar.affinity import Sessions, session_key
from sidecar.answers import (
    Failure,
    Refusal,
    all_skipped,
    deadline_failure,
    error_answer,
    refuse,
    upstream_failure,
)
from sidecar.attempt_warnings import AttemptWarnings
from sidecar.body import body_model, rewrite_model
from sidecar.breakers.machine import Permit, Verdict
from sidecar.breakers.types import Target
from sidecar.causes import TIMEOUT, answer_cause
from sidecar.choice import choose
from sidecar.client_deadline import announced_timeout_s, is_client_retry, time_to_answer_s
from sidecar.commit_input import read_commit_input, read_deferred_first
from sidecar.exchange import FIRST_BYTE, IDLE, REQUEST, Exchange
from sidecar.generation import Generation, Runtime
from sidecar.hedge import HEDGED, NOT_SENT, WON, Race, child_exchange, search
from sidecar.intake import check_expect, read_body
from sidecar.judge import CONTEXT_WINDOW, RATE_LIMIT_FAILURE, Judgement, judge, no_retry_hint
from sidecar.metrics import Recorder
from sidecar.outcome import (
    FIRST_BYTE_DETAIL,
    IDLE_DETAIL,
    Outcome,
    UpstreamError,
    UpstreamTimeout,
    is_fallback_status,
)
from sidecar.relay import relay
from sidecar.routes import Candidate, Route
from sidecar.sse_hold import Verdict as Said
from sidecar.target import KNOWN_HOSTS, has_dot_segment, host_failure, path_readings
from sidecar.target_stats import TargetStats
from sidecar.tracing.attributes import FALLBACK, FIRST, HEDGE
from sidecar.upstream import Upstream, send
from sidecar.usage import Usage
from sidecar.wire import DownstreamConnection, wide_head

if TYPE_CHECKING:
    from sidecar.tracing.runtime import Tracing
    from sidecar.tracing.spans import Attempt

Answer = tuple[ClientResponse, bytes | None, Upstream, Target, Usage | None]
"""A candidate call's final answer before the commit point: response, the bytes read
(None: not yet), upstream, target, and its token usage so far (an event stream's or a
judged JSON answer's; else None). A plain tuple: one is made per request."""


class Proxy:
    """The proxy port's request handler (``aiohttp.web.Server``'s handler).

    :param runtime: the current config generation, in-flight count, draining flag.
    :param recorder: where metrics are reported.
    :param tracer: the process's tracer (``[tracing]``), or None: no tracing, and each
        request pays one ``is None`` test per hook (:mod:`sidecar.tracing`).
    """

    def __init__(self, runtime: Runtime, recorder: Recorder, tracer: Tracing | None = None) -> None:
        self.runtime = runtime
        self.metrics = recorder
        self.tracer = tracer
        self.sessions = Sessions()
        """The sessions of every route with ``affinity_header`` (kept across reloads)."""
        self.warnings = AttemptWarnings()
        """The rate-limited ``upstream_attempt_failed`` warning (kept across reloads)."""

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer one request on the proxy port (see the module docstring)."""
        conn: DownstreamConnection = request.protocol  # type: ignore[assignment]
        conn.busy += 1  # the request head arrived: no head deadline while it is served
        try:
            if hdrs.EXPECT in request.headers:
                check_expect(request)  # 417; a 100 Continue waits for read_body's checks
            if not request.path.startswith("/"):  # CONNECT host:port, OPTIONS *
                raise web.HTTPNotFound()
            rt = self.runtime
            gen = rt.current
            if rt.inflight >= gen.config.server.max_concurrent_requests:
                self.metrics.answered("", 503)
                access_log.refused(gen.config.server, request, Failure.OVERLOADED.code)
                return error_answer(Failure.OVERLOADED, request.path, 0)
            rt.inflight += 1
            gen.users += 1
            self.metrics.request_started()
            clock = gen.clock
            # The handler's own task (``request.task`` is the connection's).
            task: asyncio.Task[object] = asyncio.current_task()  # type: ignore[assignment]
            ex = Exchange(clock, task, clock.now())
            if conn.wide and wide_head(request):  # obs-text is relayed as it came
                ex.raw_head = True
            if self.tracer is not None:  # [tracing]: the SERVER span, when sampled
                ex.trace = self.tracer.request(request)
            try:
                resp = await self._serve(request, gen, ex)
                ex.answered(resp)
                return resp
            except asyncio.CancelledError:
                ex.left()
                raise
            finally:
                ex.close()
                if ex.target is not None:
                    self._relayed(ex)
                rt.inflight -= 1
                gen.users -= 1
                if gen.users == 0 and rt.retired:
                    rt.release(gen)
                self.metrics.request_ended(ex.route, ex.status, clock.now() - ex.started)
                if ex.trace is not None:  # every span of the request ends
                    ex.trace.end(ex)
                if gen.config.server.access_log:
                    access_log.emit(ex, request)
        finally:
            conn.request_ended()

    async def _serve(
        self, request: web.BaseRequest, gen: Generation, ex: Exchange
    ) -> web.StreamResponse:
        path = request.path
        server = gen.config.server
        version = request.version
        if version is not HttpVersion11 and version.major > 1:  # RFC 9110 section 15.6.6
            return await refuse(request, Refusal.VERSION)
        if not request.raw_path.startswith("/"):
            return error_answer(Failure.NOT_A_PATH, path, 0)
        headers = request.headers
        host = headers.get(hdrs.HOST)
        if host not in KNOWN_HOSTS and (failure := host_failure(host)) is not None:
            return error_answer(failure, path, 0)
        body = await read_body(request, server, ex)
        if type(body) is not bytes:
            if isinstance(body, Refusal):
                return await refuse(request, body)
            assert isinstance(body, Failure)
            return error_answer(body, path, 0)
        if "/." in path and has_dot_segment(path):
            raw = request.raw_path.partition("?")[0]
            same, route = gen.routes.resolve_readings(path_readings(path, raw), headers, body)
            if not same:
                return error_answer(Failure.DOT_SEGMENTS, path, 0)
        else:
            route = gen.routes.resolve(path, headers, body)
        if route is None:
            # Contract: 400 only when a route here needed the model and the body has
            # none to give; a JSON body whose model no route lists is a 404.
            needed = gen.routes.needs_model(path, headers) and body_model(body) is None
            return error_answer(Failure.MODEL_NEEDED if needed else Failure.NO_ROUTE, path, 0)
        ex.route = route.name
        ex.start_request(server.request_timeout_s)
        hint = server.client_retry_hint
        announced = announced_timeout_s(headers)  # the client's own deadline, if it says
        if announced is not None:
            ex.bound_request(ex.started + time_to_answer_s(announced))
            if ex.time_left() <= 0.0:  # the client gives up before any answer could come
                ex.end_request()
                return error_answer(Failure.DEADLINE, path, 0, retry_hint=hint)
        try:
            result = await self._candidates(request, gen, route, body, ex)
        except asyncio.CancelledError:
            if ex.expired() is not REQUEST:
                raise
            # ``request_timeout_ms`` ran out before the commit point.
            return error_answer(deadline_failure(ex.last_error), path, ex.attempts, retry_hint=hint)
        if isinstance(result, tuple):
            response, first, up, ex.target, ex.usage = result
            ex.upstream = up.name
            if first is None:  # a retried status relayed as it came: its body not read yet
                try:
                    first = await read_deferred_first(response, ex, up.first_byte_s)
                except UpstreamError as err:
                    response.close()
                    ex.upstream_error = err.cause
                    assert ex.target is not None
                    self.warnings.failed(ex.target, err, gen.clock.now())
                    return error_answer(upstream_failure(err), path, ex.attempts, retry_hint=hint)
                except asyncio.CancelledError:
                    response.close()
                    raise
            ex.end_request()  # the commit point: request_timeout_ms ran to here
            if ex.trace is not None:
                ex.trace.committed(response, gen.clock.now())
            retried = ex.attempts > 1 or ex.fallbacks > 0
            no_retry = retried and no_retry_hint(  # (never without a retry or a fallback)
                enabled=hint,
                own_error=None,
                failing_status=is_fallback_status(
                    response.status, up.retry_statuses, up.failure_statuses
                ),
                retried_or_fell_back=retried,
            )
            return await relay(request, response, first, up, ex, no_retry=no_retry)
        ex.end_request()
        if isinstance(result, UpstreamError):
            return error_answer(upstream_failure(result), path, ex.attempts, retry_hint=hint)
        # Every candidate skipped by its breaker: 503 circuit_open, or 429 rate_limited.
        failures, wait = _skips(gen, route, headers)
        return all_skipped(failures, wait, path, ex.attempts, hint)

    async def _candidates(
        self, request: web.BaseRequest, gen: Generation, route: Route, body: bytes, ex: Exchange
    ) -> Answer | UpstreamError | None:
        """The fallback loop: the route's candidates (in order; with tiers as
        :func:`_members` yields them, a session's member first), each skipped by its
        breaker (open, half-open and full, or ramping) or called (:meth:`_call`), until
        one's answer is committed to; a session's request then settles its session.

        Every fallback is counted here (``sidecar_fallbacks_total``: ``circuit_open``
        for a skipped candidate, else the call's reason), and only when a next
        candidate exists. A deadline's cancellation is not caught here (:meth:`_serve`).

        :returns: the answer to relay (a success, a caller's answer, or the last
            failing HTTP answer), the last transport failure, or None when every
            candidate was skipped by its breaker.
        """
        # ``gen.breakers`` is read at each use, not kept: a reload hands a retired
        # generation's in-flight calls to the current breakers (Runtime.retire).
        last: Answer | UpstreamError | None = None
        n = len(route.candidates)
        session: bytes | None = None  # a session of affinity_header: its key
        kept_to: Target | None = None  # and the member it keeps to
        if route.affinity_header is not None:
            value = request.headers.get(route.affinity_header)
            if value:
                session = session_key(route.name, value)
                kept_to = self.sessions.member(session, gen.clock.now())
        order = route.candidates if route.tiers is None else _members(route, gen, kept_to)
        if route.hedge_after_s:  # hedged first token: its own loop, never on other routes
            return await self._hedged(request, gen, route, body, ex, iter(order), session, kept_to)
        for k, cand in enumerate(order, 1):
            permit, why = self._admit(gen, cand, request.headers)
            if gen.breakers.lease_needed(permit):  # the fleet's one probe: at most 250 ms
                try:
                    permit = await gen.breakers.lease(permit)
                except asyncio.CancelledError:
                    if isinstance(last, tuple):  # an earlier candidate's answer: not relayed
                        self._drop(route.name, last)
                    raise
                why = "circuit_open"  # (when the lease went to another member)
            if permit is None:
                if ex.trace is not None:
                    ex.trace.skipped(cand.upstream, cand.model, body, why)
            else:
                if isinstance(last, tuple):
                    self._drop(route.name, last)
                reason = FIRST if k == 1 else FALLBACK  # sidecar.attempt.reason
                last, moved = await self._call(request, gen, route, cand, permit, body, ex, reason)
                if moved is None:  # the commit point: no retry and no fallback after this
                    if session is not None:
                        self._session(route, gen, session, kept_to, cand.target)
                    return last
                why = moved
            if k < n:  # a candidate is left to try
                ex.fallbacks += 1
                self.metrics.fallback(route.name, cand.upstream, why)
        return last

    async def _hedged(
        self,
        request: web.BaseRequest,
        gen: Generation,
        route: Route,
        body: bytes,
        ex: Exchange,
        order: Iterator[Candidate],
        session: bytes | None,
        kept_to: Target | None,
    ) -> Answer | UpstreamError | None:
        """The fallback loop of a route with ``hedge_after_ms`` (:mod:`sidecar.hedge` has
        the race's design): as :meth:`_candidates`' loop, each candidate skipped by its
        breaker or called, and the one being called raced by the next one when it has
        not reached its commit point ``hedge_after_ms`` after it was sent (once per
        request). The loop reads the candidates through the :class:`~sidecar.hedge.Race`
        (the ones the hedge's search took first); at the hedged candidate it waits for
        the running hedge instead of calling it again. Fallbacks are counted per
        candidate as in :meth:`_candidates`; ``sidecar_hedges_total`` once per request
        whose hedge was due (:attr:`Exchange.hedge` for the access log).

        :returns: as :meth:`_candidates`.
        """
        race: Race[Answer] = Race(route.hedge_after_s, order, ex)
        last: Answer | UpstreamError | None = None
        n = len(route.candidates)
        done = 0
        ex.hedge = ""  # the access log's hedge field: null until one is due
        try:
            while (item := race.next()) is not None:
                cand, why = item
                done += 1
                if why is HEDGED:  # the primary failed: the hedge goes on alone
                    if isinstance(last, tuple):
                        self._drop(route.name, last)
                    last, moved = await race.join()
                    if moved is None:
                        race.outcome = WON
                        break
                    why = moved
                elif why is None:
                    permit, why = self._admit(gen, cand, request.headers)
                    if gen.breakers.lease_needed(permit):  # the fleet's one probe
                        try:
                            permit = await gen.breakers.lease(permit)
                        except asyncio.CancelledError:
                            if isinstance(last, tuple):
                                self._drop(route.name, last)
                            raise
                        why = "circuit_open"
                    if permit is not None:
                        if isinstance(last, tuple):
                            self._drop(route.name, last)
                        reason = FIRST if done == 1 else FALLBACK  # sidecar.attempt.reason
                        last, moved, cand = await self._raced(
                            race, request, gen, route, cand, permit, body, ex, reason
                        )
                        if moved is None:
                            break
                        why = moved
                    elif ex.trace is not None:
                        ex.trace.skipped(cand.upstream, cand.model, body, why)
                elif ex.trace is not None:  # passed over by the hedge's search: refused
                    ex.trace.skipped(cand.upstream, cand.model, body, why)
                if done < n:  # a candidate is left to try (or running)
                    ex.fallbacks += 1
                    self.metrics.fallback(route.name, cand.upstream, why)
            else:
                return last
            # The commit point: no retry and no fallback after this.
            if session is not None:
                self._session(route, gen, session, kept_to, cand.target)
            return last
        except BaseException:
            await race.stop()  # the client left, or the deadline: the hedge too
            raise
        finally:
            left = race.take()  # a hedge's answer not relayed: counted, closed
            if left is not None and isinstance(left[0], tuple):
                left[0][0].close()
                self._drop(route.name, left[0])
            outcome = race.outcome
            if outcome is not None:
                ex.hedge = outcome
                if outcome is not NOT_SENT:  # counted when the timer fired
                    self.metrics.hedge(route.name, outcome)

    async def _raced(
        self,
        race: Race[Answer],
        request: web.BaseRequest,
        gen: Generation,
        route: Route,
        cand: Candidate,
        permit: Permit,
        body: bytes,
        ex: Exchange,
        reason: str,
    ) -> tuple[Answer | UpstreamError, str | None, Candidate]:
        """One candidate call of :meth:`_hedged`, raced by a hedge when one is still due
        (not for a half-open probe: its answer is what its breaker waits for).

        :returns: :meth:`_call`'s result and the candidate whose result it is: the
            hedge's, when the hedge reached its commit point first.
        :raises asyncio.CancelledError: the client's or a deadline's (the hedge is
            stopped by :meth:`_hedged`).
        """
        if not race.due or permit.probe:
            answer, moved = await self._call(request, gen, route, cand, permit, body, ex, reason)
            # No hedge runs here (Race.launch orders the loop to join it first); were one
            # to, it would lose to this answer, stopped before the relay, never left behind.
            await self._hedge_loses(race, route, answer, moved)
            return answer, moved, cand
        race.arm(gen.clock, lambda: self._send_hedge(race, request, gen, route, body, ex))
        race.primary_running = True
        try:
            answer, moved = await self._call(request, gen, route, cand, permit, body, ex, reason)
        except asyncio.CancelledError:
            race.primary_running = False
            # The hedge reached its commit point first and cancelled this task (the
            # primary's attempt was counted "cancelled", its permit released, its
            # connection closed): take that cancellation back and relay the hedge.
            if not race.won or ex.task.uncancel() > 0:
                raise  # cancelled from elsewhere too (the client, a deadline)
            # The primary's attempt is over: its first-byte deadline, and a wait for a
            # pooled connection it was cut in (which pauses phase deadlines), must not
            # outlive it into the relay of the hedge's answer (its idle deadline).
            ex.queued = False
            ex.stop_phase()
            result = race.take()
            assert result is not None and race.hedged is not None
            race.outcome = WON
            return result[0], result[1], race.hedged
        finally:
            race.primary_running = False
            race.disarm()
        await self._hedge_loses(race, route, answer, moved)  # the primary first
        return answer, moved, cand

    async def _hedge_loses(
        self,
        race: Race[Answer],
        route: Route,
        answer: Answer | UpstreamError,
        moved: str | None,
    ) -> None:
        """A call of :meth:`_hedged` other than the hedge reached its commit point
        (``moved`` None): a hedge still running loses; it is stopped, and waited for,
        before the relay (its attempts count in the header, nothing is left running)."""
        if moved is None and race.task is not None:
            try:
                await race.stop()
            except BaseException:
                if isinstance(answer, tuple):
                    self._drop(route.name, answer)
                raise

    def _send_hedge(
        self,
        race: Race[Answer],
        request: web.BaseRequest,
        gen: Generation,
        route: Route,
        body: bytes,
        ex: Exchange,
    ) -> None:
        """The hedge timer fired (a clock callback): send the hedge to the next candidate
        whose breaker admits it (a permit fit for a hedge: no probe, no fleet lease),
        within that upstream's retry budget, or count it ``not_sent``."""
        breakers = gen.breakers
        found, passed = search(
            race.order,
            lambda c: self._admit(gen, c, request.headers),
            lambda p: not p.probe and not breakers.lease_needed(p),
            breakers.release,
        )
        race.pending.extend(passed)
        if found is None:
            race.not_sent()
            self.metrics.hedge(route.name, NOT_SENT)
            return
        cand, permit = found
        budget = gen.upstreams[cand.upstream].budget
        if not budget.take():  # the hedge holds the budget as a retry would
            breakers.release(permit)
            race.pending.append((cand, None))  # the loop asks its breaker again
            race.not_sent()
            self.metrics.hedge(route.name, NOT_SENT)
            return
        child = child_exchange(ex)
        race.launch(
            cand,
            permit,
            budget,
            child,
            lambda: self._call(request, gen, route, cand, permit, body, child, HEDGE),
            breakers.release,
        )

    def _admit(
        self, gen: Generation, cand: Candidate, headers: CIMultiDictProxy[str]
    ) -> tuple[Permit | None, str]:
        """The breaker questions of both fallback loops (and the hedge's search): a
        permit for ``cand`` (target, then the request's credential), or None and the
        fallback reason of its skip (``ramp`` or ``circuit_open``). A permit that needs
        the fleet's lease is the loop's to take."""
        breakers = gen.breakers
        permit = breakers.admit(cand.target)
        by_credential = False
        if permit is not None and breakers.credentials.held:  # rate_limit_scope
            permit = breakers.admit_credential(permit, headers)
            by_credential = permit is None
        if permit is None:
            ramp = not by_credential and breakers.ramping(cand.target)
            return None, "ramp" if ramp else "circuit_open"
        return permit, ""

    async def _call(
        self,
        request: web.BaseRequest,
        gen: Generation,
        route: Route,
        cand: Candidate,
        permit: Permit,
        body: bytes,
        ex: Exchange,
        reason: str,
    ) -> tuple[Answer | UpstreamError, str | None]:
        """The retry loop: up to ``1 + max_retries`` attempts on one candidate, each
        sent, read to its commit point (:func:`~sidecar.commit_input.read_commit_input`)
        and judged (:func:`~sidecar.judge.judge`); the call is then recorded on the
        candidate's breaker once (``permit`` is always settled).

        A retry waits ``up.retry_wait`` (aiohttp-retry's backoff schedule, with full
        jitter unless ``retry.jitter`` is off, or the answer's ``Retry-After``) and is
        not made when the request deadline would pass first, on a half-open probe (one
        request, never retried), when the breaker moved meanwhile (asked before and
        after the wait), for a request that is itself a client's retry
        (``x-stainless-retry-count`` >= 1: read only here), or past the upstream's
        retry budget (:mod:`sidecar.retry_budget`; the call then ends with the failure
        it has, fallback reason ``budget``); the last two are counted in
        ``sidecar_retries_skipped_total``. A retry holds the budget from its grant to
        the end of its attempt. An empty turn is retried once, never more.

        ``reason`` says why the call is made (``first``, ``fallback``, ``hedge``: its
        attempts' ``sidecar.attempt.reason``, with ``retry`` and ``probe``).

        :returns: the call's final answer (or its last transport failure) and, when
            the route moves on from it, the fallback reason (``failure``,
            ``context_window``, ``empty_turn``, ``budget``); None to commit to the answer.
        :raises asyncio.CancelledError: a deadline's or the client's; the current
            attempt is counted (``outcome="cancelled"``) once it was sent.
        """
        clock, metrics, target = gen.clock, self.metrics, cand.target
        up = gen.upstreams[cand.upstream]
        cw = route.context_window_fallback
        data = body if cand.model is None else rewrite_model(body, cand.model)
        url, headers = up.url(request.raw_path), up.headers(request.headers)
        response: ClientResponse | None = None
        ex.last_error = None  # a transport failure of this call, kept while its retry is pending
        stats = cand.stats
        if stats is not None:
            stats.in_flight += 1
        budget = up.budget
        budget.requests += 1
        in_retry = False  # a retry granted by the budget, not yet ended
        skipped: str | None = None  # "budget": the fallback reason of a refused retry
        settled = False
        empty_retried = False  # an empty turn is retried once, never more
        trace = ex.trace
        span: Attempt | None = None  # the attempt's CLIENT span ([tracing], sampled)
        try:
            retry = 0
            while True:
                first: bytes | None = None
                said: Said | None = None
                usage: Usage | None = None
                j: Judgement | None = None
                err: UpstreamError | None = None
                retry_after: float | None = None
                sent_at = clock.now()
                ex.output_at = None  # a JSON body an earlier attempt began: not this one's
                ex.start(FIRST_BYTE, up.first_byte_s)
                if trace is not None:
                    span = trace.attempt(cand.upstream, cand.model, body, reason, retry,
                                         permit, headers, sent_at)  # fmt: skip
                try:
                    response = None
                    sent = headers if span is None else span.headers  # propagate: traceparent
                    response = await send(up, ex, request.method, url, sent, data)
                    first, said, usage = await read_commit_input(
                        response, up.retry_statuses, cw, ex, up.idle_s
                    )
                except UpstreamError as e:
                    err = e
                except asyncio.CancelledError:
                    # The attempt's own deadline (first byte, or idle inside a JSON body
                    # read whole) is this attempt's timeout; any other cancellation (the
                    # request deadline, the client) ends the call.
                    phase = ex.expired_phase
                    if (phase is FIRST_BYTE or phase is IDLE) and ex.expired() is not None:
                        why = FIRST_BYTE_DETAIL if phase is FIRST_BYTE else IDLE_DETAIL
                        err = UpstreamTimeout(why)
                    else:
                        if span is not None:
                            if ex.queued:  # never sent: no attempt, no CLIENT span
                                assert trace is not None
                                trace.unsent(span)
                            else:
                                span.done("cancelled", None, None, None)
                        if not ex.queued:  # sent, then cut: an attempt
                            ex.attempts += 1
                            metrics.attempt(target, "cancelled", None)
                            if phase is REQUEST:  # request_timeout_ms cut it
                                ex.upstream_error = TIMEOUT
                        raise
                ex.stop_phase()
                if in_retry:  # the retry's attempt ended: its budget is free again
                    in_retry = False
                    budget.give_back()
                ex.attempts += 1
                ex.last_error = err
                if err is not None:
                    if response is not None:
                        response.release()
                        response = None
                    metrics.attempt(target, err.outcome.value, None)
                    ex.upstream_error = err.cause
                    self.warnings.failed(target, err, clock.now())
                    if span is not None:
                        span.done(err.outcome.value, None, None, None)
                else:
                    assert response is not None
                    j, retry_after, elapsed = self._judged(
                        gen, ex, up, target, permit.probe, response, first, said, sent_at, cw
                    )
                    if span is not None:
                        span.done(j.outcome.value, response.status, usage, response)
                again = j is not None and j.retried
                if again:  # a failing answer (the success path tests only this)
                    assert j is not None and response is not None
                    ex.upstream_error = answer_cause(j.outcome, response.status)
                    if j.outcome is Outcome.EMPTY_TURN:
                        again, empty_retried = not empty_retried, True  # once, never more
                wait = up.retry_wait(retry, err, again, retry_after)
                if wait is None or wait >= ex.time_left() or not _may_retry(gen, permit):
                    break
                if is_client_retry(request.headers):  # the client retries: it has the say
                    metrics.retry_skipped(target, "client_retry")
                    break
                if not budget.take():
                    metrics.retry_skipped(target, "budget")
                    skipped = "budget"
                    break
                in_retry = True
                await clock.sleep(wait)
                if not _may_retry(gen, permit):
                    break
                if response is not None:
                    if usage is not None:  # an answer the client never gets
                        metrics.tokens(route.name, target, usage, False)
                    response.release()
                    response = None
                metrics.retry(target)
                retry += 1
            # The call is over: record it once.
            if err is not None:
                gen.breakers.record(permit, Verdict.FAILURE, last_failure=err.last_failure)
                settled = True
                return err, skipped or "failure"
            assert response is not None and j is not None
            self._settle(gen, up, permit, j, retry_after, stats, elapsed if first else None,
                         request)  # fmt: skip
            settled = True
            answer = (response, first, up, target, usage)
            response = None
            if j.moves_on:  # a failing answer, or a context window's (the caller's)
                if j.why != CONTEXT_WINDOW:
                    ex.upstream_error = answer_cause(j.outcome, answer[0].status)
                return answer, skipped or j.why
            return answer, None
        finally:
            if response is not None:
                response.release()
            if not settled:
                gen.breakers.release(permit)
            if stats is not None:
                stats.in_flight -= 1
            budget.requests -= 1
            if in_retry:
                budget.give_back()

    def _judged(
        self,
        gen: Generation,
        ex: Exchange,
        up: Upstream,
        target: Target,
        probe: bool,
        response: ClientResponse,
        first: bytes | None,
        said: Said | None,
        sent_at: float,
        cw: bool,
    ) -> tuple[Judgement, float | None, float]:
        """The judge step of one attempt's answer at its commit point, and its metrics.

        :returns: the judgement, the answer's ``Retry-After`` in seconds (or None), and
            its time to first output in seconds (a JSON body read whole: to its first
            chunk, :attr:`~sidecar.exchange.Exchange.output_at`).
        """
        clock = gen.clock
        status = response.status
        out_at = ex.output_at
        if out_at is None:
            elapsed = clock.now() - sent_at
        else:  # a JSON body read whole: its first output was its first chunk
            elapsed = out_at - sent_at
            ex.output_at = None
        retry_after = up.answer_retry_after_s(response, clock)
        j = judge(status, first, said, up.retry_statuses, up.failure_statuses, cw,
                  up.slow_call_ms, elapsed, up.empty_turn_is_failure, probe)  # fmt: skip
        # Only a failing answer's Retry-After may extend an open breaker (contract); a
        # caller's answer is neutral, and so is a rate limit that is its credential's.
        if (
            retry_after is not None
            and status in up.failure_statuses
            and not (j.rate_limit and gen.breakers.credentials.header(target) is not None)
        ):
            gen.breakers.note_retry_after(target, up.capped(retry_after))
        self.metrics.attempt(target, j.outcome.value, elapsed if first and not j.retried else None)
        return j, retry_after, elapsed

    def _settle(
        self,
        gen: Generation,
        up: Upstream,
        permit: Permit,
        j: Judgement,
        retry_after: float | None,
        stats: TargetStats | None,
        first_output_s: float | None,
        request: web.BaseRequest,
    ) -> None:
        """Record a candidate call that ended in an answer on its breaker (once), with a
        failing answer's capped ``Retry-After``; count a slow call; feed the chooser's
        time to first output (``first_output_s``: None when the answer had no body).
        A rate limit goes with the ``request``'s headers, whose credential it may count
        against (``rate_limit_scope``)."""
        failed = j.verdict is Verdict.FAILURE
        ra = up.capped(retry_after) if failed and retry_after is not None else None
        rl = j.rate_limit  # the request's headers are read for a rate limit only
        headers = request.headers if rl else None
        gen.breakers.record(permit, j.verdict, last_failure=j.last_failure, retry_after_s=ra,
                            rate_limit=rl, headers=headers)  # fmt: skip
        if j.slow:
            self.metrics.slow_call(permit.target)
        # A success's time to first output feeds the chooser, a slow call's too (a
        # failure with an answer: its time is what the chooser needs).
        answered = j.slow or j.verdict is Verdict.SUCCESS
        if stats is not None and first_output_s is not None and answered:
            stats.first_output(first_output_s, gen.clock.now())

    def _session(
        self, route: Route, gen: Generation, key: bytes, kept_to: Target | None, served: Target
    ) -> None:
        """Settle a session's request (:meth:`sidecar.affinity.Sessions.settle`): it moves
        only when the member it kept to is refused by its breaker now."""
        refuses = (
            kept_to is not None and kept_to != served and (gen.breakers.retry_in((kept_to,)) != 0.0)
        )
        now = gen.clock.now()
        result = self.sessions.settle(
            key, kept_to, served, route.first_tier, refuses, route.affinity_ttl_s, now
        )
        if result is not None:
            self.metrics.affinity(route.name, result)

    def _drop(self, route: str, answer: Answer) -> None:
        """Let go of a final answer that will not be relayed (the route moved on): its
        reported tokens count with ``relayed="false"``."""
        response, _, _, target, usage = answer
        if usage is not None:
            self.metrics.tokens(route, target, usage, False)
        response.release()

    def _relayed(self, ex: Exchange) -> None:
        """At the handler's end, for a committed answer: its tokens, and a cut after
        the commit point (``sidecar_stream_aborts_total``)."""
        target = ex.target
        assert target is not None
        if ex.usage is not None:
            self.metrics.tokens(ex.route, target, ex.usage, True)
        if ex.first_byte_s is None:
            return
        if ex.aborted:
            self.metrics.stream_aborted(target, ex.abort_reason)
        elif ex.client_left:
            self.metrics.stream_aborted(target, "drain" if self.runtime.draining else "client_left")


def _members(route: Route, gen: Generation, kept_to: Target | None) -> Iterator[Candidate]:
    """The members of ``route``'s tiers in the order this request tries them: the member
    a session keeps to first (``kept_to``, of the first tier), then tiers ascending,
    inside each the chooser's pick (:func:`sidecar.choice.choose`) among the members
    not tried yet; a member its breaker skips counts as tried."""
    assert route.tiers is not None
    tried: Collection[Target] = ()  # a set once a member was tried: most requests need none
    if kept_to is not None:
        for cand in route.tiers[0]:
            if cand.target == kept_to:
                tried = {kept_to}
                yield cand
                break
    for tier in route.tiers:
        while (member := choose(tier, tried, route.balance, gen.draw, gen.pool_full)) is not None:
            yield member
            tried = {*tried, member.target}  # when the next member is asked for


def _skips(
    gen: Generation, route: Route, headers: CIMultiDictProxy[str]
) -> tuple[list[str | None], float | None]:
    """When every candidate of ``route`` was skipped: each one's ``last_failure`` (a
    candidate skipped on the caller's own rate limit, its target admitting others, says
    ``http_429``) and the seconds until the soonest one admits this request (None:
    unknown), for :func:`sidecar.answers.all_skipped`."""
    breakers = gen.breakers
    failures: list[str | None] = []
    waits: list[float] = []
    for cand in route.candidates:
        t = cand.target
        wait = breakers.retry_in((t,))
        refused, key_wait = breakers.credential_skip(t, headers)
        if refused and wait == 0.0:
            failures.append(RATE_LIMIT_FAILURE)
            waits.append(key_wait)
            continue
        failures.append(breakers.last_failure(t))
        if wait is not None:
            waits.append(wait)
    return failures, min(waits, default=None)


def _may_retry(gen: Generation, permit: Permit) -> bool:
    return not permit.probe and gen.breakers.may_continue(permit)

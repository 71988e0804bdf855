"""The proxy handler: what happens to one request, top to bottom, on one page.

::

    admit        in-flight cap (503 overloaded); a request target and Host fit to relay
    body         read up to max_request_body_bytes (413), within client_read_timeout_ms
    route        routes.resolve(path, headers, body)              404 / 400
    for candidate in route.candidates:                            the fallback loop
        permit = breakers.admit(target)                           None -> skip it
        for each attempt (1 + max_retries):                       the retry loop
            response = await send(...)                            status and headers
            first    = await first_output(response)               the commit point's input
            judge(status, first): success / caller's -> commit; failure -> retry, fall back
        breakers.record(permit, verdict)                          once per candidate call
    relay        status, headers, first chunk, then the rest      no retry, no replay
    end          metrics (and, later, the access log) from the Exchange

**The commit point** is owned here: it is the first response body chunk. Until it
arrives the client has seen nothing, and a failure may be retried or fall back.
After it (:mod:`sidecar.relay`) a failure aborts the client connection.

Every deadline (request, first byte, idle, body) is one float on the request's
:class:`~sidecar.exchange.Exchange`, served by one timer on the injected clock. A
permit is always settled: by ``record`` with the call's verdict, or by ``release``
in a ``finally`` (cancellation by a client disconnect or a deadline, or a bug).
Failures become the contract's error answers in one place,
:func:`sidecar.answers.error_answer`.
"""

from __future__ import annotations

import asyncio
import math
from typing import cast

from aiohttp import ClientResponse, hdrs, web

from sidecar.answers import Failure, deadline_failure, error_answer, upstream_failure
from sidecar.body import body_model, rewrite_model
from sidecar.breaker import Permit, Verdict
from sidecar.client_connections import ClientConnection
from sidecar.exchange import FIRST_BYTE, REQUEST, Exchange
from sidecar.generation import Generation, Runtime
from sidecar.intake import expect_continue, read_body
from sidecar.metrics import Recorder
from sidecar.outcome import (
    UpstreamError,
    UpstreamTimeout,
    judge,
    status_label,
    status_outcome,
)
from sidecar.relay import relay
from sidecar.retry_after import parse_retry_after
from sidecar.routes import Route
from sidecar.upstream import Upstream, first_output, send

CLIENT_CLOSED_REQUEST = 499
"""``code`` label of a request whose client went away before an answer (nginx's 499)."""

Answer = tuple[ClientResponse, bytes | None, Upstream]
"""A final upstream answer before the commit point: response, first chunk (None: not
read yet), and the upstream it came from."""


class _Deadline(Exception):
    """``request_timeout_ms`` ran out; carries the transport failure being retried, if any."""

    def __init__(self, last_error: UpstreamError | None) -> None:
        self.last_error = last_error


class Proxy:
    """The proxy port's request handler (``aiohttp.web.Server``'s handler).

    :param runtime: the current config generation, in-flight count, draining flag.
    :param recorder: where metrics are reported.
    """

    def __init__(self, runtime: Runtime, recorder: Recorder) -> None:
        self.runtime = runtime
        self.metrics = recorder

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer one request on the proxy port (see the module docstring)."""
        conn = cast(ClientConnection, request.protocol)
        conn.busy += 1  # the request head arrived: no head deadline while it is served
        try:
            if request.headers.get(hdrs.EXPECT):
                await expect_continue(request)
            if not request.path.startswith("/"):  # CONNECT host:port, OPTIONS *
                raise web.HTTPNotFound()
            rt = self.runtime
            gen = rt.current
            if rt.inflight >= gen.config.server.max_concurrent_requests:
                self.metrics.answered("", 503)
                return error_answer(Failure.OVERLOADED, request.path, 0)
            rt.inflight += 1
            gen.users += 1
            self.metrics.request_started()
            clock = gen.clock
            # The handler's own task (``request.task`` is the connection's).
            task = cast("asyncio.Task[object]", asyncio.current_task())
            ex = Exchange(clock, task, clock.now())
            try:
                resp = await self._serve(request, gen, ex)
                ex.status = resp.status
                return resp
            except asyncio.CancelledError:
                ex.status = CLIENT_CLOSED_REQUEST
                raise
            finally:
                ex.close()
                rt.inflight -= 1
                gen.users -= 1
                if gen.users == 0 and rt.retired:
                    rt.release(gen)
                # Issue #14's access log line goes here, from `ex`.
                self.metrics.request_ended(ex.route, ex.status, clock.now() - ex.started)
        finally:
            conn.request_ended()

    async def _serve(
        self, request: web.BaseRequest, gen: Generation, ex: Exchange
    ) -> web.StreamResponse:
        path = request.path
        server = gen.config.server
        if not request.raw_path.startswith("/"):
            return error_answer(Failure.NOT_A_PATH, path, 0)
        if hdrs.HOST not in request.headers:
            return error_answer(Failure.NO_HOST, path, 0)
        body = await read_body(request, server, ex)
        if isinstance(body, Failure):
            return error_answer(body, path, 0)
        headers = request.headers
        route = gen.routes.resolve(path, headers, body)
        if route is None:
            # Contract: 400 only when a route here needed the model and the body has
            # none to give; a JSON body whose model no route lists is a 404.
            needed = gen.routes.needs_model(path, headers) and body_model(body) is None
            return error_answer(Failure.MODEL_NEEDED if needed else Failure.NO_ROUTE, path, 0)
        ex.route = route.name
        ex.start_request(server.request_timeout_s)
        try:
            result = await self._candidates(request, gen, route, body, ex)
        except _Deadline as deadline:
            return error_answer(deadline_failure(deadline.last_error), path, ex.attempts)
        ex.end_request()
        if isinstance(result, tuple):
            response, first, up = result
            ex.upstream = up.name
            return await relay(request, response, first, up, ex)
        if isinstance(result, UpstreamError):
            return error_answer(upstream_failure(result), path, ex.attempts)
        # Every candidate skipped by its breaker. Whole seconds until the soonest
        # probe, rounded up; at least 1 (also when every half-open slot is taken).
        wait = gen.breakers.retry_in(c.target for c in route.candidates)
        retry_after = 1 if wait is None else max(1, math.ceil(wait))
        return error_answer(Failure.ALL_OPEN, path, ex.attempts, retry_after=retry_after)

    async def _candidates(
        self, request: web.BaseRequest, gen: Generation, route: Route, body: bytes, ex: Exchange
    ) -> Answer | UpstreamError | None:
        """The fallback loop over ``route.candidates``, each with its retry loop.

        :returns: the answer to relay (a success, a caller's answer, or the last
            failing HTTP answer), the last transport failure, or None when every
            candidate was skipped by its breaker.
        :raises _Deadline: ``request_timeout_ms`` ran out.
        """
        breakers, clock, metrics = gen.breakers, gen.clock, self.metrics
        method = request.method
        last: Answer | UpstreamError | None = None
        n = len(route.candidates)
        for i, cand in enumerate(route.candidates):
            target = cand.target
            permit = breakers.admit(target)
            permit = await breakers.lease(permit) if breakers.lease_needed(permit) else permit
            if permit is None:
                if i + 1 < n:  # a fallback moves on to a next candidate, as for "failure"
                    ex.fallbacks += 1
                    metrics.fallback(route.name, cand.upstream, "circuit_open")
                continue
            if isinstance(last, tuple):
                last[0].release()
            up = gen.upstreams[cand.upstream]
            data = body if cand.model is None else rewrite_model(body, cand.model)
            url, headers = up.url(request.raw_path), up.headers(request.headers)
            response: ClientResponse | None = None
            last_error: UpstreamError | None = None  # kept while its retry is pending
            settled = False
            try:
                retry = 0
                while True:  # the retry loop: 1 + max_retries attempts on this candidate
                    first: bytes | None = None
                    err: UpstreamError | None = None
                    retry_after: float | None = None
                    sent_at = clock.now()
                    ex.start(FIRST_BYTE, up.first_byte_s)
                    try:
                        response = None
                        response = await send(up, ex, method, url, headers, data)
                        if response.status not in up.retry_statuses:
                            first = await first_output(response)
                    except UpstreamError as e:
                        err = e
                    except asyncio.CancelledError:
                        phase = ex.expired()
                        if phase is not FIRST_BYTE:
                            if not ex.queued:  # sent, then cut: an attempt
                                ex.attempts += 1
                                metrics.attempt(target, "cancelled", None)
                            if phase is REQUEST:
                                raise _Deadline(last_error) from None
                            raise
                        err = UpstreamTimeout("first byte")
                    ex.stop_phase()
                    ex.attempts += 1
                    if err is not None:
                        last_error = err
                        if response is not None:
                            response.release()
                            response = None
                        metrics.attempt(target, err.outcome.value, None)
                    else:
                        assert response is not None
                        last_error = None
                        status = response.status
                        elapsed = clock.now() - sent_at
                        if status >= 400:
                            retry_after = parse_retry_after(
                                response.headers.get("Retry-After"), clock.wall(clock.now())
                            )
                            # Only a failing answer's Retry-After may extend an open
                            # breaker (contract); a caller's answer is neutral.
                            if retry_after is not None and status in up.failure_statuses:
                                breakers.note_retry_after(
                                    target, min(retry_after, up.retry_after_max_s)
                                )
                        outcome = status_outcome(status, first == b"")
                        metrics.attempt(target, outcome.value, elapsed if first else None)
                    # Before a retry: the deadline must outlast the wait; a half-open
                    # probe is one request, never retried; the breaker must not have
                    # moved meanwhile (asked before and after the wait).
                    wait = up.retry_wait(retry, err, first is None, retry_after)
                    if wait is None or wait >= ex.time_left() or not _may_retry(gen, permit):
                        break
                    try:
                        await clock.sleep(wait)
                    except asyncio.CancelledError:
                        if ex.expired() is REQUEST:
                            raise _Deadline(last_error) from None
                        raise
                    if not _may_retry(gen, permit):
                        break
                    if response is not None:
                        response.release()
                        response = None
                    metrics.retry(target)
                    retry += 1
                # The candidate call is over: record it once, then commit or move on.
                if err is not None:
                    breakers.record(permit, Verdict.FAILURE, last_failure=err.last_failure)
                    settled = True
                    last = err
                    if i + 1 < n:
                        ex.fallbacks += 1
                        metrics.fallback(route.name, cand.upstream, "failure")
                    continue
                assert response is not None
                status = response.status
                verdict, moves_on = judge(status, first, up.retry_statuses, up.failure_statuses)
                failed = verdict is Verdict.FAILURE
                ra = min(retry_after, up.retry_after_max_s) if retry_after is not None else None
                breakers.record(
                    permit,
                    verdict,
                    last_failure=status_label(status) if failed else None,
                    retry_after_s=ra if failed else None,
                )
                settled = True
                last = (response, first, up)
                response = None
                if moves_on:
                    if i + 1 < n:
                        ex.fallbacks += 1
                        metrics.fallback(route.name, cand.upstream, "failure")
                    continue
                return last  # the commit point: no retry and no fallback after this
            finally:
                if response is not None:
                    response.release()
                if not settled:
                    breakers.release(permit)
        return last


def _may_retry(gen: Generation, permit: Permit) -> bool:
    return not permit.probe and gen.breakers.may_continue(permit)

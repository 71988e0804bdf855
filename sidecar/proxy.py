"""The proxy handler: route, candidates, breaker permits, and the commit point.

Flow of one request (contract, "The proxy port")::

    body  = read up to server.max_request_body_bytes         413 past it
    route = routes.resolve(path, model)                       404 / 400
    within server.request_timeout_ms:
      for candidate in route.candidates:                      ordered fallback
        permit = breakers.admit(target)                       None -> skip (rejection)
        answer = await CandidateCall(...).run()               retries inside (aiohttp-retry)
        breakers.record(permit, verdict)                      once per candidate call
        fallback status -> next candidate; otherwise commit
    relay: status, headers, first chunk, then the rest        no retry, no replay

**The commit point** is the first response body chunk: until it arrives the
client has seen nothing and any failure may be retried or fall back. After it,
a failure or an idle gap longer than ``idle_timeout_ms`` aborts the client
connection, so a truncated stream never ends as if complete.

A permit is always settled: by ``record`` with the call's verdict, or by
``release`` in a ``finally`` (cancellation by a client disconnect, the request
deadline, or a bug).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
from aiohttp import hdrs, web

from sidecar import logs, metrics
from sidecar.body import json_object, rewrite_model
from sidecar.breaker import Permit, Verdict
from sidecar.breaker_runtime import BreakerRuntime
from sidecar.errors import ErrorCode, error_body
from sidecar.headers import SIDECAR_ATTEMPTS, SIDECAR_ERROR, client_response_headers
from sidecar.outcome import (
    Outcome,
    UpstreamError,
    UpstreamTimeout,
    is_fallback_status,
    status_label,
    status_verdict,
)
from sidecar.routes import Candidate, Route
from sidecar.runtime import RUNTIME, Generation
from sidecar.upstream import Answer, AttemptObserver, CandidateCall, translate

JSON_CONTENT_TYPE = "application/json"
CLIENT_CLOSED_REQUEST = 499
"""``code`` label of a request whose client went away before an answer (nginx's 499)."""


class _Ctx:
    """Per-request mutable state shared by every candidate call."""

    __slots__ = ("attempts", "call", "deadline", "route")

    def __init__(self) -> None:
        self.attempts = 0
        self.deadline: float | None = None
        """When ``request_timeout_ms`` runs out, on the event loop's clock."""
        self.call: CandidateCall | None = None
        self.route = ""
        """The chosen route's name (metric label); "" until a route is chosen."""

    def deadline_error(self) -> ErrorCode:
        """The answer when the request deadline runs out before the commit point.

        Contract: while a transport failure is being retried, the transport
        failure (502); otherwise a timeout (504).
        """
        err = self.call.last_error if self.call is not None else None
        if err is not None and not isinstance(err, UpstreamTimeout):
            return ErrorCode.UPSTREAM_UNAVAILABLE
        return ErrorCode.UPSTREAM_TIMEOUT


class _Observer(AttemptObserver):
    """Reports one candidate call's attempts to metrics, the request and the breaker."""

    __slots__ = ("breakers", "ctx", "labels", "permit")

    def __init__(
        self, ctx: _Ctx, candidate: Candidate, permit: Permit, breakers: BreakerRuntime
    ) -> None:
        self.ctx = ctx
        self.labels = candidate.target
        self.permit = permit
        self.breakers = breakers

    def attempt(self, outcome: Outcome, first_byte_s: float | None) -> None:
        self.ctx.attempts += 1
        up, model = self.labels
        metrics.attempts(up, model, outcome.value).inc()
        if first_byte_s is not None:
            metrics.first_byte(up, model).observe(first_byte_s)

    def retrying(self) -> None:
        metrics.RETRIES.labels(*self.labels).inc()

    def failing_answer(self, retry_after_s: float) -> None:
        self.breakers.note_retry_after(self.labels, retry_after_s)

    def may_retry(self) -> bool:
        # A half-open probe is one request, never retried: "exactly one probe
        # tests recovery" without hammering a provider that is still sick.
        return not self.permit.probe and self.breakers.may_continue(self.permit)

    def time_left(self) -> float:
        deadline = self.ctx.deadline
        return math.inf if deadline is None else deadline - asyncio.get_running_loop().time()


def error_response(
    code: ErrorCode,
    path: str,
    attempts: int,
    *,
    message: str | None = None,
    retry_after: int | None = None,
    close: bool = False,
) -> web.Response:
    """The sidecar's own error answer (contract table), with ``x-sidecar-*`` headers."""
    resp = web.Response(
        status=code.status,
        body=error_body(code, path, message),
        content_type=JSON_CONTENT_TYPE,
    )
    resp.headers[SIDECAR_ERROR] = code.code
    resp.headers[SIDECAR_ATTEMPTS] = str(attempts)
    if retry_after is not None:
        resp.headers["Retry-After"] = str(retry_after)
    if close:
        resp.force_close()
    return resp


async def handle(request: web.Request) -> web.StreamResponse:
    """aiohttp handler for every path on the proxy port."""
    rt = request.app[RUNTIME]
    gen = rt.current
    server = gen.config.server
    if rt.inflight >= server.max_concurrent_requests:
        metrics.REQUESTS.labels("", "503").inc()
        return error_response(ErrorCode.OVERLOADED, request.path, 0)
    rt.inflight += 1
    gen.users += 1
    metrics.INFLIGHT.inc()
    started = time.perf_counter()
    ctx = _Ctx()
    status = 500
    try:
        resp = await _proxy(request, gen, ctx)
        status = resp.status
        return resp
    except asyncio.CancelledError:
        status = CLIENT_CLOSED_REQUEST
        raise
    finally:
        rt.inflight -= 1
        gen.users -= 1
        if gen.users == 0 and rt.retired:
            rt.release(gen)
        metrics.INFLIGHT.dec()
        metrics.requests(ctx.route, status).inc()
        metrics.request_duration(ctx.route).observe(time.perf_counter() - started)


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes | None:
    """The whole request body, or None when it is over ``limit`` bytes."""
    length = request.content_length
    if length is not None and length > limit:
        return None
    content = request.content
    if content.is_eof():
        # Fast path: the whole body came with the head (most LLM requests); no
        # timer needed to wait for it.
        data = content.read_nowait()
        return data if len(data) <= limit else None
    parts: list[bytes] = []
    size = 0
    async with asyncio.timeout(timeout_s):
        while True:
            data = await request.content.readany()
            if not data:
                break
            size += len(data)
            if size > limit:
                return None
            parts.append(data)
    return b"".join(parts)


def _unrelayable(raw_target: str, has_host: bool) -> str | None:
    """Why a request line / Host makes a request unfit to relay (message for the 400), or None.

    * The target must be in origin form (``/path?query``). The absolute form
      (``GET http://evil.example/v1/x``, meant for a forward proxy) is refused:
      the sidecar relays only to its configured upstreams and is never an open
      forward proxy, and the target is appended to ``base_url`` as received.
      aiohttp exposes it as ``request.raw_path`` (the target as sent), while
      ``request.path`` and ``request.host`` already show the URL's parts.
    * A ``Host`` header is required. aiohttp's parser refuses HTTP/1.1 without
      one; an HTTP/1.0 request without one is refused here, as Envoy does (it
      supports HTTP/1.0 without Host only with ``default_host_for_http_10``).
    """
    if not raw_target.startswith("/"):
        return "the request target must be a path: this is not a forward proxy"
    if not has_host:
        return "a Host header is required"
    return None


async def _proxy(request: web.Request, gen: Generation, ctx: _Ctx) -> web.StreamResponse:
    path = request.path
    server = gen.config.server
    refused = _unrelayable(request.raw_path, hdrs.HOST in request.headers)
    if refused is not None:
        return error_response(ErrorCode.BAD_REQUEST, path, 0, message=refused, close=True)
    try:
        body = await _read_body(
            request, server.max_request_body_bytes, server.client_read_timeout_ms / 1000
        )
    except TimeoutError:
        return error_response(
            ErrorCode.BAD_REQUEST, path, 0, message="request body not received in time", close=True
        )
    if body is None:
        return error_response(ErrorCode.REQUEST_TOO_LARGE, path, 0, close=True)

    doc: list[Any] = []

    def model() -> str | None:
        if not doc:
            doc.append(json_object(body))
        value = doc[0].get("model") if doc[0] is not None else None
        return value if isinstance(value, str) else None

    route = gen.routes.resolve(path, model)
    if route is None:
        if gen.routes.needs_model(path):
            return error_response(
                ErrorCode.BAD_REQUEST,
                path,
                0,
                message="no route for this model (body must be JSON with a model)",
            )
        return error_response(ErrorCode.NO_ROUTE, path, 0)

    ctx.route = route.name
    try:
        async with asyncio.timeout(server.request_timeout_ms / 1000) as deadline:
            ctx.deadline = deadline.when()
            result = await _try_candidates(request, gen, route, body, ctx)
    except TimeoutError:
        return error_response(ctx.deadline_error(), path, ctx.attempts)
    if isinstance(result, Answer):
        return await _relay(request, result, ctx)
    if isinstance(result, UpstreamTimeout):
        return error_response(ErrorCode.UPSTREAM_TIMEOUT, path, ctx.attempts)
    if isinstance(result, UpstreamError):
        return error_response(ErrorCode.UPSTREAM_UNAVAILABLE, path, ctx.attempts)
    # Whole seconds until the soonest probe, rounded up; at least 1 (also when
    # every half-open probe slot is taken and the wait is unknown).
    wait = gen.breakers.retry_in(c.target for c in route.candidates)
    return error_response(
        ErrorCode.CIRCUIT_OPEN,
        path,
        ctx.attempts,
        retry_after=1 if wait is None else max(1, math.ceil(wait)),
    )


async def _try_candidates(
    request: web.Request, gen: Generation, route: Route, body: bytes, ctx: _Ctx
) -> Answer | UpstreamError | None:
    """Ordered fallback over ``route.candidates`` up to the commit point.

    :returns: the :class:`Answer` to relay (a success, a caller error, or the
        last failing HTTP answer), the last transport error, or None when every
        candidate was skipped by its breaker.
    """
    breakers = gen.breakers
    last: Answer | UpstreamError | None = None
    rewritten: dict[str, bytes] = {}
    n = len(route.candidates)
    for i, cand in enumerate(route.candidates):
        permit = breakers.admit(cand.target)
        if permit is not None and breakers.lease_needed(permit):  # [fleet] half-open only
            permit = await breakers.lease(permit)
        if permit is None:
            if i + 1 < n:  # a fallback moves on to a next candidate, as for "failure"
                metrics.FALLBACKS.labels(route.name, cand.upstream, "circuit_open").inc()
            continue
        if isinstance(last, Answer):
            last.response.release()
        up = gen.upstreams[cand.upstream]
        data = body
        if cand.model is not None:
            if cand.model not in rewritten:
                rewritten[cand.model] = rewrite_model(body, cand.model)
            data = rewritten[cand.model]
        call = CandidateCall(
            up,
            method=request.method,
            url=up.url(request.raw_path),
            headers=up.headers(request.headers),
            body=data,
            clock=gen.clock,
            observer=_Observer(ctx, cand, permit, breakers),
        )
        ctx.call = call
        settled = False
        try:
            try:
                answer = await call.run()
            except UpstreamError as err:
                breakers.record(permit, Verdict.FAILURE, last_failure=err.last_failure)
                settled = True
                last = err
                if i + 1 < n:
                    metrics.FALLBACKS.labels(route.name, cand.upstream, "failure").inc()
                continue
            status = answer.response.status
            failure_statuses = up.failure_statuses
            verdict = status_verdict(status, answer.first_chunk == b"", failure_statuses)
            retry_after = answer.retry_after_s
            breakers.record(
                permit,
                verdict,
                last_failure=status_label(status) if verdict is Verdict.FAILURE else None,
                retry_after_s=None
                if retry_after is None or verdict is not Verdict.FAILURE
                else min(retry_after, up.retry_after_max_s),
            )
            settled = True
            last = answer
            if is_fallback_status(status, up.retry_statuses, failure_statuses):
                if i + 1 < n:
                    metrics.FALLBACKS.labels(route.name, cand.upstream, "failure").inc()
                continue
            return answer
        finally:
            if not settled:
                breakers.release(permit)
    return last


async def _relay(request: web.Request, answer: Answer, ctx: _Ctx) -> web.StreamResponse:
    """Send the committed answer to the client and pump the rest of the body.

    After the first byte reaches the client there is no retry and no replay: an
    upstream failure or an idle gap over ``idle_timeout_ms`` aborts the client
    connection (never a clean end of a truncated stream).
    """
    upstream_resp = answer.response
    up = answer.upstream
    complete = False
    try:
        first = answer.first_chunk
        if first is None:  # a final failing answer relayed as it came: read its start now
            try:
                async with asyncio.timeout(up.first_byte_s):
                    first = await upstream_resp.content.readany()
            except Exception as exc:
                err = translate(exc) if not isinstance(exc, TimeoutError) else UpstreamTimeout()
                if err is None:
                    raise
                code = (
                    ErrorCode.UPSTREAM_TIMEOUT
                    if isinstance(err, UpstreamTimeout)
                    else ErrorCode.UPSTREAM_UNAVAILABLE
                )
                return error_response(code, request.path, ctx.attempts)
        headers = client_response_headers(
            upstream_resp.headers, upstream=up.name, attempts=ctx.attempts
        )
        content = upstream_resp.content
        if (
            first
            and content.at_eof()
            and hdrs.CONTENT_LENGTH in headers
            and request.method != "HEAD"
        ):
            # The whole body is already here (a typical JSON answer): one write
            # carries status, headers and body, with the upstream's own framing.
            complete = True
            whole = web.Response(
                status=upstream_resp.status,
                reason=upstream_resp.reason,
                headers=headers,
                body=first,
            )
            # Sent here, not after the handler returns, so the request's duration
            # and a client leaving during the write are seen by this request.
            await whole.prepare(request)
            await whole.write_eof()
            return whole
        resp = web.StreamResponse(
            status=upstream_resp.status, reason=upstream_resp.reason, headers=headers
        )
        await resp.prepare(request)
        if first:
            await resp.write(first)
        loop = asyncio.get_running_loop()
        idle = up.idle_s
        try:
            async with asyncio.timeout(idle) as cm:
                while True:
                    chunk = await content.readany()
                    if not chunk:
                        break
                    await resp.write(chunk)
                    cm.reschedule(loop.time() + idle)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if isinstance(exc, ConnectionResetError) and request.transport is None:
                return resp  # the client went away
            logs.event(
                "stream_aborted",
                upstream=up.name,
                reason="idle_timeout" if isinstance(exc, TimeoutError) else type(exc).__name__,
            )
            if request.transport is not None:
                request.transport.abort()
            return resp
        complete = True
        await resp.write_eof()
        return resp
    finally:
        # A body not read to its end leaves the connection unusable: close it.
        if complete:
            upstream_resp.release()
        else:
            upstream_resp.close()

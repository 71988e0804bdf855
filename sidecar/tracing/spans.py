"""One request's spans: a SERVER span, and a CLIENT span per upstream attempt.

Imported only with ``[tracing]`` (:mod:`sidecar.tracing`). The proxy calls a few
hooks on :class:`RequestTrace`, each behind ``if ex.trace is not None`` (None: tracing
off, or this request not sampled):

==========================  =====================================================
``Tracing.request``         the request arrived: its SERVER span, the app's
                            ``traceparent`` as parent (:mod:`sidecar.tracing`)
:meth:`RequestTrace.skipped`  a candidate skipped by its breaker: an event
:meth:`RequestTrace.attempt`  an attempt is about to be sent: its CLIENT span, and
                            the headers to send (``propagate``)
:meth:`Attempt.done`        the attempt ended: outcome, status, usage so far
:meth:`RequestTrace.committed`  the commit point: an event on the committed attempt
:meth:`RequestTrace.end`    the handler ends: every span ends, the SERVER span last
==========================  =====================================================

**When a CLIENT span ends.** Every attempt's span is ended when the request ends,
with its own end time: the time its attempt ended (:meth:`Attempt.done`), except the
committed attempt's, which ends with the relay (so its duration is the whole answer,
and its token usage is what the relayed answer reported). Spans are exported only
once ended, so a trace is complete when it reaches the collector.

No value here comes from a header (but the ``traceparent`` that parents the trace), a
body (but its JSON ``model`` name), a key or a URL's credentials
(:mod:`sidecar.tracing.attributes`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from sidecar.access_log import outcome as request_outcome
from sidecar.body import body_model
from sidecar.tracing.attributes import (
    MAX_MODEL_CHARS,
    attempt_reason,
    breaker_state,
    client_span_name,
    traceparent,
    usage_attributes,
)
from sidecar.usage import Usage

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

    from sidecar.breakers.types import Permit
    from sidecar.exchange import Exchange

TRACEPARENT = "traceparent"

_SUCCESS = "success"


class Attempt:
    """One upstream attempt's CLIENT span (made by :meth:`RequestTrace.attempt`).

    ``headers``: the headers to send for this attempt: the candidate call's own list,
    or with ``propagate`` a copy whose ``traceparent`` names this span.
    """

    __slots__ = ("committed", "end_ns", "headers", "response", "sent_at", "span", "usage")

    def __init__(self, span: Span, headers: list[tuple[str, str]], sent_at: float) -> None:
        self.span = span
        self.headers = headers
        self.sent_at = sent_at
        """When it was sent, on the request's injected clock (seconds)."""
        self.end_ns: int | None = None
        self.response: object | None = None
        """The answer it got (compared by identity at the commit point), or None."""
        self.usage: Usage | None = None
        self.committed = False

    def done(self, outcome: str, status: int | None, usage: Usage | None, response: object) -> None:
        """The attempt ended: ``outcome`` (``sidecar_upstream_attempts_total``'s:
        ``success``, ``http_5xx``, ``connect_error``, ``cancelled``...; ``error.type``
        when not ``success``), its HTTP ``status`` (None: no answer), the ``usage`` read
        up to its commit point, and its ``response`` (None without one)."""
        self.end_ns = time.time_ns()
        span = self.span
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if outcome != _SUCCESS:
            span.set_attribute("error.type", outcome)
            span.set_status(Status(StatusCode.ERROR))
        self.usage = usage
        self.response = response


class RequestTrace:
    """The spans of one sampled request (see the module docstring).

    :param tracer: the process's tracer.
    :param span: the request's SERVER span (recording).
    :param method: the request's method (the span's name, with the route).
    :param operation: its ``gen_ai.operation.name`` (None: not a GenAI API).
    :param propagate: ``tracing.propagate``: attempts carry a ``traceparent``.
    :param addresses: ``server.address`` by upstream name (the host of its ``base_url``).
    """

    __slots__ = (
        "_body_model",
        "_ctx",
        "_renumber",
        "addresses",
        "attempts",
        "method",
        "operation",
        "propagate",
        "span",
        "tracer",
    )

    def __init__(
        self,
        tracer: Tracer,
        span: Span,
        method: str,
        operation: str | None,
        propagate: bool,
        addresses: dict[str, str],
    ) -> None:
        self.tracer = tracer
        self.span = span
        self.method = method
        self.operation = operation
        self.propagate = propagate
        self.addresses = addresses
        self.attempts: list[Attempt] = []
        self._ctx: Context = set_span_in_context(span)
        self._body_model: str | bool | None = False  # False: not read yet
        self._renumber = False  # an attempt was withdrawn (:meth:`unsent`)

    def model(self, configured: str | None, body: bytes) -> str | None:
        """``gen_ai.request.model``: the candidate's configured model, else the body's
        JSON ``model`` (read once per request; cut at
        :data:`~sidecar.tracing.attributes.MAX_MODEL_CHARS`), else None."""
        if configured is not None:
            return configured
        found = self._body_model
        if found is False:
            m = body_model(body)
            found = self._body_model = None if m is None else m[:MAX_MODEL_CHARS]
        assert found is not True
        return found

    def skipped(self, upstream: str, configured: str | None, body: bytes, reason: str) -> None:
        """A candidate skipped by its breaker: a ``sidecar.skipped`` event on the SERVER
        span (``sidecar.upstream``, ``gen_ai.request.model``, ``sidecar.reason``:
        ``circuit_open`` or ``ramp``, as ``sidecar_fallbacks_total`` says)."""
        attrs: dict[str, str] = {"sidecar.upstream": upstream, "sidecar.reason": reason}
        model = self.model(configured, body)
        if model is not None:
            attrs["gen_ai.request.model"] = model
        self.span.add_event("sidecar.skipped", attrs)

    def attempt(
        self,
        upstream: str,
        configured: str | None,
        body: bytes,
        call_reason: str,
        retry: int,
        permit: Permit,
        headers: list[tuple[str, str]],
        sent_at: float,
    ) -> Attempt:
        """Start the CLIENT span of the request's next attempt (``sidecar.attempt`` 1, 2,
        ... in the order they were sent, a hedge's racing attempts included) to
        ``upstream``, retry ``retry`` (0: the first) of a candidate call made for
        ``call_reason`` (``first``, ``fallback``, ``hedge``) and admitted with ``permit``
        (:func:`~sidecar.tracing.attributes.attempt_reason`,
        :func:`~sidecar.tracing.attributes.breaker_state`).

        :param headers: the upstream request's headers; with ``propagate`` the attempt's
            are a copy whose ``traceparent`` (any the app sent is replaced) names this
            span; its ``tracestate`` goes on as it came (W3C Trace Context, section 3.3).
        :param sent_at: now, on the request's injected clock.
        """
        model = self.model(configured, body)
        attrs: dict[str, str | int] = {
            "sidecar.upstream": upstream,
            "sidecar.attempt": len(self.attempts) + 1,
            "sidecar.attempt.reason": attempt_reason(call_reason, retry, permit.probe),
            "sidecar.breaker.state": breaker_state(permit.generation, permit.probe),
            "server.address": self.addresses.get(upstream, ""),
        }
        if self.operation is not None:
            attrs["gen_ai.operation.name"] = self.operation
        if model is not None:
            attrs["gen_ai.request.model"] = model
        span = self.tracer.start_span(
            client_span_name(self.operation, model),
            context=self._ctx,
            kind=SpanKind.CLIENT,
            attributes=attrs,
        )
        if self.propagate:
            sc = span.get_span_context()
            headers = [(k, v) for k, v in headers if k.lower() != TRACEPARENT]
            headers.append((TRACEPARENT, traceparent(sc.trace_id, sc.span_id, True)))
        att = Attempt(span, headers, sent_at)
        self.attempts.append(att)
        return att

    def unsent(self, att: Attempt) -> None:
        """The attempt ``att`` was cut before it was sent (it waited for a pooled
        connection): it is no upstream attempt (``x-sidecar-attempts`` does not count
        it), so it is no CLIENT span. Its span is withdrawn and never ended (an
        OpenTelemetry span is exported only once ended); the attempts after it are
        numbered again at :meth:`end` (``sidecar.attempt`` stays the header's count)."""
        if att in self.attempts:
            self.attempts.remove(att)
            self._renumber = True

    def committed(self, response: object, now: float) -> None:
        """The commit point of the answer ``response``: a ``sidecar.commit`` event on the
        attempt that got it, with ``sidecar.time_to_first_output_ms`` (from when that
        attempt was sent; ``now`` on the request's injected clock)."""
        for att in self.attempts:
            if att.response is response:
                att.committed = True
                ms = round((now - att.sent_at) * 1000, 3)
                att.span.add_event("sidecar.commit", {"sidecar.time_to_first_output_ms": ms})
                return

    def end(self, ex: Exchange) -> None:
        """The request ended (the handler's ``finally``): end every attempt's span (the
        committed one now, with the relayed answer's usage; the others at their own
        end), then the SERVER span with the request's status, route and outcome
        (the access log's)."""
        now = time.time_ns()
        for n, att in enumerate(self.attempts, 1):
            if self._renumber:
                att.span.set_attribute("sidecar.attempt", n)
            if att.committed:
                usage = ex.usage if ex.usage is not None else att.usage
                att.span.set_attributes(usage_attributes(usage))
                att.span.end(now)
            else:
                att.span.set_attributes(usage_attributes(att.usage))
                att.span.end(att.end_ns if att.end_ns is not None else now)
            att.response = None
        span = self.span
        status = ex.status
        route = ex.route
        if route:
            span.update_name(f"{self.method} {route}")
            span.set_attribute("sidecar.route", route)
        span.set_attribute("http.response.status_code", status)
        span.set_attribute(
            "sidecar.outcome", request_outcome(status, ex.error, ex.aborted, ex.client_left)
        )
        if status >= 500:  # OpenTelemetry's HTTP conventions: a SERVER span's 5xx is an error
            span.set_status(Status(StatusCode.ERROR))
        span.end(now)

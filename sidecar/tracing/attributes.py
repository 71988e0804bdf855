"""What the sidecar's spans say, as plain values (pure; no OpenTelemetry import).

Contract, "Traces": the SERVER span of a request carries ``http.request.method``,
``url.path`` (never the query), ``http.response.status_code``, ``sidecar.route`` and
``sidecar.outcome``; each CLIENT span of an attempt ``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` / ``gen_ai.usage.output_tokens``
(when reported), ``server.address``, ``http.response.status_code``, ``error.type``,
``sidecar.upstream``, ``sidecar.attempt``, ``sidecar.attempt.reason`` and
``sidecar.breaker.state``. The ``gen_ai.*`` names are OpenTelemetry's GenAI semantic
conventions (status "Development" upstream: names may still change); the others are
OpenTelemetry's stable HTTP conventions and the sidecar's own ``sidecar.*`` names.

Nothing here reads a header value, a body (but the JSON ``model`` name), a key or a
URL's credentials: every value is a config name, a count, a status, a path or a
model name.
"""

from __future__ import annotations

from sidecar.usage import Usage

FIRST = "first"
"""``sidecar.attempt.reason`` of a request's first attempt."""
RETRY = "retry"
"""An attempt retried on the same candidate."""
FALLBACK = "fallback"
"""The first attempt on a candidate after an earlier one was tried."""
PROBE = "probe"
"""An attempt admitted as a half-open breaker's probe (never retried)."""
HEDGE = "hedge"
"""An attempt sent to race a slow one (route ``hedge_after_ms``)."""
REASONS = (FIRST, RETRY, FALLBACK, PROBE, HEDGE)

MAX_MODEL_CHARS = 256
"""A body's ``model`` longer than this is cut (a span attribute stays small)."""

_OPERATIONS = (
    ("/chat/completions", "chat"),
    ("/messages", "chat"),
    ("/responses", "chat"),
    ("/completions", "text_completion"),
    ("/embeddings", "embeddings"),
)
"""Path endings -> ``gen_ai.operation.name`` (the GenAI conventions' well-known values;
OpenAI's Responses API and Anthropic's Messages API are chat)."""


def operation_name(path: str) -> str | None:
    """``gen_ai.operation.name`` of a request path (``/v1/chat/completions`` -> ``chat``,
    ``/v1/embeddings`` -> ``embeddings``), or None for any other API (``/v1/models``):
    the attribute is then left out."""
    path = path.rstrip("/")
    for end, name in _OPERATIONS:
        if path.endswith(end):
            return name
    return None


def attempt_reason(call_reason: str, retry: int, probe: bool) -> str:
    """``sidecar.attempt.reason`` of one attempt.

    :param call_reason: why its candidate call was made: :data:`FIRST`,
        :data:`FALLBACK` or :data:`HEDGE`.
    :param retry: retries made before it on this candidate (0: the call's first attempt).
    :param probe: the call holds a half-open probe slot (a probe is never retried).

    A hedge is a hedge whatever else it is; a probe is a probe (first or fallback);
    otherwise a later attempt on the same candidate is a retry.
    """
    if call_reason == HEDGE:
        return HEDGE
    if probe:
        return PROBE
    return call_reason if retry == 0 else RETRY


def breaker_state(generation: int, probe: bool) -> str:
    """``sidecar.breaker.state`` of an admitted call, from its permit: ``half_open`` for a
    probe, ``closed`` otherwise, ``none`` for a target without a breaker (its permit's
    generation is -1)."""
    if generation < 0:
        return "none"
    return "half_open" if probe else "closed"


def usage_attributes(usage: Usage | None) -> dict[str, int]:
    """``gen_ai.usage.input_tokens`` and ``gen_ai.usage.output_tokens`` from a reported
    usage (each only when reported).

    The GenAI conventions count input tokens *including* cached ones; the sidecar's
    :class:`~sidecar.usage.Usage` keeps them apart (``input`` is the uncached part), so
    the input attribute is ``input + cache_read + cache_write`` of what was reported:
    OpenAI's ``prompt_tokens``, or Anthropic's three input counts summed.
    """
    if usage is None:
        return {}
    out: dict[str, int] = {}
    parts = [n for n in (usage.input, usage.cache_read, usage.cache_write) if n is not None]
    if parts:
        out["gen_ai.usage.input_tokens"] = sum(parts)
    if usage.output is not None:
        out["gen_ai.usage.output_tokens"] = usage.output
    return out


def client_span_name(operation: str | None, model: str | None) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}`` (the GenAI conventions' span
    name), falling back to what is known, or ``upstream`` when neither is."""
    parts = [p for p in (operation, model) if p]
    return " ".join(parts) if parts else "upstream"


def traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    """A W3C ``traceparent`` value (Trace Context level 1, section 3.2): version 00,
    the 32- and 16-hex-digit ids, and the sampled flag."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"

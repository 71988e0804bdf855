"""Judging an answer by what it says (pure): context window, retry hint, rate limits, slow calls.

Each function is one rule of the contract (``docs/interface.md``), with no IO and
no clock: the request path calls it at its commit point with what it knows.

- :func:`is_context_window_overflow`: "Context-window overflow";
- :func:`no_retry_hint`: "Client retries" (``server.client_retry_hint``);
- :func:`all_skipped_error`: the ``circuit_open`` / ``rate_limited`` rows of the
  error table;
- :func:`slow_call_verdict`: ``circuit_breaker.slow_call_ms``;
- :func:`judge`: the request path's judge step, one answer at its commit point
  (status, what its body said, how long its first output took) -> a
  :class:`Judgement` (breaker verdict, attempt outcome, retry, fall back).
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import NamedTuple

from sidecar.breakers.machine import Verdict
from sidecar.errors import ErrorCode
from sidecar.outcome import (
    Outcome,
    is_fallback_status,
    status_label,
    status_outcome,
    status_verdict,
)
from sidecar.sse_hold import Verdict as Said

__all__ = [
    "CONTEXT_WINDOW",
    "CONTEXT_WINDOW_MARKERS",
    "CONTEXT_WINDOW_SCAN_BYTES",
    "CONTEXT_WINDOW_STATUSES",
    "EMPTY_TURN",
    "NO_RETRY_ERRORS",
    "RATE_LIMIT_FAILURE",
    "SHOULD_RETRY",
    "SLOW_CALL",
    "Judgement",
    "all_skipped_error",
    "is_context_window_overflow",
    "judge",
    "no_retry_hint",
    "slow_call_verdict",
]

CONTEXT_WINDOW_STATUSES = frozenset({400, 413})
"""Statuses whose body is read for a context-window marker."""
CONTEXT_WINDOW_SCAN_BYTES = 64 * 1024
"""Only this much of the body (the first bytes) is searched."""
CONTEXT_WINDOW_MARKERS = (
    b"context_length_exceeded",
    b"context_window_exceeded",
    b"prompt is too long",
    b"maximum context length",
    b"context window",
)
"""Lower-case markers; the body is matched in any letter case (ASCII)."""

NO_RETRY_ERRORS = frozenset(
    {
        ErrorCode.UPSTREAM_UNAVAILABLE,
        ErrorCode.UPSTREAM_TIMEOUT,
        ErrorCode.CIRCUIT_OPEN,
        ErrorCode.RATE_LIMITED,
    }
)
"""The sidecar's own errors after which another try is futile or already done."""

RATE_LIMIT_FAILURE = "http_429"
"""The ``last_failure`` of a breaker that opened on rate limits."""
SHOULD_RETRY = "x-should-retry"
"""The response header the official SDKs read before retrying (value ``false``)."""
EMPTY_TURN = "empty_turn"
"""The ``last_failure``, attempt ``outcome`` and fallback ``reason`` of an empty turn."""
CONTEXT_WINDOW = "context_window"
"""The fallback ``reason`` of a context-window overflow (the caller's answer, not a failure)."""
SLOW_CALL = "slow_call"
"""The ``last_failure`` (and ``/status`` text) of a success counted as a failure."""


def is_context_window_overflow(status: int, body_head: bytes) -> bool:
    """True when a candidate's answer says the prompt does not fit the model.

    ``status`` 400 or 413 and the body's first :data:`CONTEXT_WINDOW_SCAN_BYTES`
    (``body_head``; longer input is cut here) hold one of
    :data:`CONTEXT_WINDOW_MARKERS` in any letter case: OpenAI's
    ``"code": "context_length_exceeded"``, Anthropic's ``prompt is too long: ...``,
    vLLM's ``maximum context length``... A compressed body (``Content-Encoding``)
    holds no readable marker, so it is never one.

    Contract, "Context-window overflow": such an answer moves on to the next
    candidate when the route has ``context_window_fallback``; never retried on
    the same candidate; neutral for the breaker; the last candidate's is relayed.
    """
    if status not in CONTEXT_WINDOW_STATUSES:
        return False
    text = body_head[:CONTEXT_WINDOW_SCAN_BYTES].lower()
    return any(marker in text for marker in CONTEXT_WINDOW_MARKERS)


def no_retry_hint(
    *,
    enabled: bool,
    own_error: ErrorCode | None,
    failing_status: bool,
    retried_or_fell_back: bool,
) -> bool:
    """True when the answer gets ``x-should-retry: false`` (contract, "Client retries").

    ``enabled``: ``server.client_retry_hint``. ``own_error``: the code of an
    answer the sidecar made itself, None for a relayed upstream answer.
    ``failing_status``: the relayed status is in the candidate's
    ``retry.statuses`` or ``circuit_breaker.failure_statuses``
    (:func:`sidecar.outcome.is_fallback_status`). ``retried_or_fell_back``: this
    request made more than one upstream attempt, or left a candidate (a
    skipped open candidate included) before the one relayed.

    Set on the sidecar's ``upstream_unavailable``, ``upstream_timeout``,
    ``circuit_open`` and ``rate_limited``, and on a relayed failing answer after
    a retry or a fallback. Never on successes, caller answers, ``overloaded`` (a
    later try may pass), other own errors, or a failing answer relayed with no
    retry and no fallback (the client's own retry is then the only one).
    """
    if not enabled:
        return False
    if own_error is not None:
        return own_error in NO_RETRY_ERRORS
    return failing_status and retried_or_fell_back


def all_skipped_error(last_failures: Iterable[str | None]) -> ErrorCode:
    """The answer when every candidate was skipped by an open (or full half-open) breaker.

    ``last_failures``: the ``last_failure`` of each skipped candidate's breaker.
    ``RATE_LIMITED`` (429, Anthropic ``rate_limit_error``) when every one is
    :data:`RATE_LIMIT_FAILURE` (``http_429``), so the caller's SDK raises its
    rate-limit error and backs off; else ``CIRCUIT_OPEN`` (503). Both carry the
    same ``Retry-After`` (seconds until the soonest probe). An empty input is
    ``CIRCUIT_OPEN``.
    """
    seen = False
    for failure in last_failures:
        if failure != RATE_LIMIT_FAILURE:
            return ErrorCode.CIRCUIT_OPEN
        seen = True
    return ErrorCode.RATE_LIMITED if seen else ErrorCode.CIRCUIT_OPEN


def slow_call_verdict(verdict: Verdict, first_output_s: float, slow_call_ms: int) -> Verdict:
    """The breaker verdict of a committed answer once ``slow_call_ms`` is applied.

    A ``SUCCESS`` whose first output took longer than ``slow_call_ms``
    (milliseconds; 0 = off) is a ``FAILURE`` with ``last_failure``
    :data:`SLOW_CALL`: it counts towards ``failure_threshold`` and does not reset
    the count, while the answer is still relayed whole. ``first_output_s``
    (seconds) is timed like the first-byte timeout: from when the attempt was
    sent to the commit point (the first body chunk; for streamed answers the
    first event with output). Any other verdict is returned unchanged.
    """
    if verdict is Verdict.SUCCESS and slow_call_ms > 0 and first_output_s * 1000 > slow_call_ms:
        return Verdict.FAILURE
    return verdict


class Judgement(NamedTuple):
    """What the judge step decided about one attempt's answer (see :func:`judge`)."""

    verdict: Verdict
    """The breaker's verdict if this answer ends the candidate call."""
    outcome: Outcome
    """The attempt's ``outcome`` label (``sidecar_upstream_attempts_total``)."""
    retried: bool
    """Worth another attempt on the same candidate (the retry budget permitting)."""
    moves_on: bool
    """As the call's final answer: the route moves to its next candidate (the last
    candidate's answer is then relayed as it came) instead of committing to it."""
    last_failure: str | None
    """``last_failure`` for ``/status`` when ``verdict`` is FAILURE."""
    slow: bool
    """A success counted as a failure by ``slow_call_ms`` (``sidecar_slow_calls_total``)."""
    why: str = "failure"
    """The ``reason`` of ``sidecar_fallbacks_total`` when it moves on: ``failure``,
    ``context_window`` or ``empty_turn``."""
    rate_limit: bool = False
    """A FAILURE that is a rate limit (a 429, a ``rate_limit_error`` /
    ``rate_limit_exceeded`` error event): with ``rate_limit_scope = "credential"`` it
    counts against the caller's credential, not the target
    (:mod:`sidecar.breakers.credentials`)."""


_PROVIDER_ERROR, _RATE_LIMIT_ERROR = Said.PROVIDER_ERROR, Said.RATE_LIMIT_ERROR
_CALLER_ERROR, _EMPTY = Said.CALLER_ERROR, Said.EMPTY
# (Module globals: an enum member read off its class is a slow attribute load in 3.11,
# a global is a cached one; judge() runs once per answer.)

_RATE_LIMIT_EVENT = Judgement(
    Verdict.FAILURE, Outcome.SSE_ERROR, True, True, "sse_error", False, "failure", True
)


def judge(
    status: int,
    first: bytes | None,
    said: Said | None,
    retry_statuses: Container[int],
    failure_statuses: Container[int],
    context_window_fallback: bool,
    slow_call_ms: int,
    first_output_s: float,
    empty_turn_is_failure: bool = False,
    probe: bool = False,
) -> Judgement:
    """Judge one attempt's answer at its commit point (contract, "The commit point",
    "Streamed answers", "Context-window overflow", "The circuit breaker", "Fallback").

    :param first: the body bytes read so far: the first chunk, a streamed answer's
        held bytes up to its first output event, or a 400/413 body's first 64 KiB
        (``b""``: an empty body; None: not read, a status that is retried).
    :param said: for a streamed 2xx read by :class:`~sidecar.sse_hold.SseHold`, its
        verdict (``COMMIT``, ``PROVIDER_ERROR``, ``RATE_LIMIT_ERROR``, ``CALLER_ERROR``,
        ``EMPTY``); for a
        JSON 2xx judged whole (:func:`sidecar.turn.json_turn`), ``EMPTY`` for an
        empty turn; None otherwise.
    :param first_output_s: seconds from when the attempt was sent to ``first``.
    :param empty_turn_is_failure: the upstream's ``empty_turn_is_failure``.
    :param probe: the call is a half-open probe (an empty turn is then neutral).

    Rules, in order: a provider's error event before output is a failure like a 5xx
    (``sse_error``: retried, counted, next candidate; a ``rate_limit_error`` /
    ``rate_limit_exceeded`` one is also a rate limit, as a 429 in ``failure_statuses``
    is: :attr:`Judgement.rate_limit`); a caller's error event is
    relayed, neutral; an empty turn (with ``empty_turn_is_failure``) is a failure
    ``empty_turn`` that moves on (retried once by the caller; neutral on a probe:
    contract, "An empty turn is a failure"); a context-window 400/413 moves on when the route has
    ``context_window_fallback``, never retried, neutral; any other answer by its
    status (``retry.statuses`` retried, ``failure_statuses`` counted, either moves
    on); a success slower than ``slow_call_ms`` (> 0) is a failure ``slow_call``,
    still relayed.
    """
    if said is _PROVIDER_ERROR:
        return Judgement(Verdict.FAILURE, Outcome.SSE_ERROR, True, True, "sse_error", False)
    if said is _RATE_LIMIT_ERROR:  # as PROVIDER_ERROR, and a rate limit
        return _RATE_LIMIT_EVENT
    if said is _CALLER_ERROR:
        return Judgement(Verdict.NEUTRAL, Outcome.HTTP_4XX, False, False, None, False)
    if said is _EMPTY and empty_turn_is_failure:
        verdict = Verdict.NEUTRAL if probe else Verdict.FAILURE
        return Judgement(verdict, Outcome.EMPTY_TURN, True, True, EMPTY_TURN, False, EMPTY_TURN)
    outcome = status_outcome(status, first == b"")
    if context_window_fallback and first and is_context_window_overflow(status, first):
        return Judgement(Verdict.NEUTRAL, outcome, False, True, None, False, CONTEXT_WINDOW)
    verdict = status_verdict(status, first == b"", failure_statuses)
    moves_on = is_fallback_status(status, retry_statuses, failure_statuses)
    retried = status in retry_statuses
    if verdict is Verdict.FAILURE:
        label = status_label(status)
        return Judgement(
            verdict, outcome, retried, moves_on, label, False, "failure", status == 429
        )
    if slow_call_verdict(verdict, first_output_s, slow_call_ms) is Verdict.FAILURE:
        return Judgement(Verdict.FAILURE, outcome, False, False, SLOW_CALL, True)
    return Judgement(verdict, outcome, retried, moves_on, None, False)

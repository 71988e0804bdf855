"""Outcomes of upstream attempts and candidate calls (pure, no IO).

One :class:`Outcome` per HTTP attempt (the ``outcome`` label of
``sidecar_upstream_attempts_total``) and one table saying, per outcome, whether
it is retried, whether it moves the route to the next candidate, and what it
means for the circuit breaker (contract, "The circuit breaker" and "Fallback").
The judgement of one answer at the commit point is :func:`sidecar.judge.judge`.

Local-origin failures (connect errors, timeouts, resets seen by the sidecar)
are kept apart from upstream-origin ones (HTTP statuses), as Envoy's outlier
detection does.

Exception tree raised by :mod:`sidecar.upstream` (the one boundary that
translates aiohttp's exceptions)::

    UpstreamError
     +-- UpstreamConnectError   connect refused / timed out / DNS / TLS / -> CONNECT_ERROR
                                egress proxy
     +-- UpstreamResetError     reset or broken response before 1st chunk -> STREAM_ERROR
     +-- UpstreamTimeout        first-byte timeout                        -> TIMEOUT
"""

from __future__ import annotations

import enum
from collections.abc import Container

from sidecar.breakers.machine import Verdict


class Outcome(enum.Enum):
    """What one upstream attempt ended in; values are the metric label values."""

    SUCCESS = "success"
    HTTP_4XX = "http_4xx"
    HTTP_429 = "http_429"
    HTTP_5XX = "http_5xx"
    CONNECT_ERROR = "connect_error"
    TIMEOUT = "timeout"
    STREAM_ERROR = "stream_error"
    CANCELLED = "cancelled"
    EMPTY = "empty"
    SSE_ERROR = "sse_error"
    """A provider's error event before any output in a streamed 2xx answer."""
    EMPTY_TURN = "empty_turn"
    """A 2xx turn that ended cleanly with no output (contract, "An empty turn is a failure")."""


class UpstreamError(Exception):
    """A failure before the commit point, already classified.

    :param detail: what the logs may say about it: the exception's class and the OS or
        TLS reason (:func:`sidecar.causes.classify`), never a URL, header or key.
    :param cause: the access log's ``upstream_error`` (``dns``, ``refused``, ``tls``,
        ``proxy``, ``reset``, ``connect_timeout``, ``timeout``); None: the class's
        :attr:`default_cause`.
    """

    outcome: Outcome = Outcome.STREAM_ERROR
    default_cause = "reset"

    def __init__(self, detail: str = "", cause: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.cause = self.default_cause if cause is None else cause

    @property
    def last_failure(self) -> str:
        """The ``last_failure`` string of ``/status`` and logs."""
        return self.outcome.value


class UpstreamConnectError(UpstreamError):
    """No connection: refused, connect timeout, DNS, TLS or egress proxy failure."""

    outcome = Outcome.CONNECT_ERROR
    default_cause = "refused"


class UpstreamResetError(UpstreamError):
    """The connection broke (reset, early close, bad framing) before the first body chunk."""

    outcome = Outcome.STREAM_ERROR


FIRST_BYTE_DETAIL = "first_byte_timeout_ms ran out"
"""The detail of the sidecar's own first-byte timeout (:class:`UpstreamTimeout`)."""
IDLE_DETAIL = "idle_timeout_ms ran out"
"""The detail of an idle timeout inside a 2xx JSON answer read whole before the commit point."""


class UpstreamTimeout(UpstreamError):
    """No first body chunk within ``first_byte_timeout_ms``."""

    outcome = Outcome.TIMEOUT
    default_cause = "timeout"


def status_outcome(status: int, first_chunk_empty: bool) -> Outcome:
    """Classify an HTTP answer: 2xx/3xx -> SUCCESS (or EMPTY with no body), 429, 4xx, 5xx."""
    if status < 400:
        return Outcome.EMPTY if first_chunk_empty else Outcome.SUCCESS
    if status == 429:
        return Outcome.HTTP_429
    if status < 500:
        return Outcome.HTTP_4XX
    return Outcome.HTTP_5XX


def status_label(status: int) -> str:
    """``last_failure`` text for an HTTP failure: ``http_503``."""
    return f"http_{status}"


def is_fallback_status(
    status: int, retry_statuses: Container[int], failure_statuses: Container[int]
) -> bool:
    """True when a final answer with ``status`` moves the route to the next candidate.

    Contract, "Fallback": statuses in ``retry.statuses`` or
    ``circuit_breaker.failure_statuses``; any other answer is the caller's.
    """
    return status in retry_statuses or status in failure_statuses


def status_verdict(
    status: int, first_chunk_empty: bool, failure_statuses: Container[int]
) -> Verdict:
    """Breaker verdict of a final HTTP answer (contract, "The circuit breaker").

    A status in ``failure_statuses`` is a FAILURE; a 2xx/3xx with a first body
    chunk is a SUCCESS; an empty 2xx/3xx and every other status are NEUTRAL.
    """
    if status in failure_statuses:
        return Verdict.FAILURE
    if status < 400 and not first_chunk_empty:
        return Verdict.SUCCESS
    return Verdict.NEUTRAL

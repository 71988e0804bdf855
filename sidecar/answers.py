"""Every way a request can end in an answer the sidecar makes itself, and that answer.

:class:`Failure` lists them; :func:`error_answer` is the one function that turns
one into the contract's error response (contract, "The proxy port": the table of
responses the sidecar makes itself): its status and ``code``
(:class:`~sidecar.errors.ErrorCode`), its body in the OpenAI or Anthropic shape
(:func:`~sidecar.errors.error_body`), ``x-sidecar-error`` and ``x-sidecar-attempts``,
``Retry-After`` where the contract asks for it, ``x-should-retry: false`` where
another try is futile (contract, "Client retries"), and ``Connection: close`` where
the rest of the request cannot be trusted. ``tests/unit/test_answers.py`` checks that
every failure kind maps to one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

from aiohttp import web

from sidecar.errors import ErrorCode, error_body
from sidecar.headers import SIDECAR_ATTEMPTS, SIDECAR_ERROR
from sidecar.judge import SHOULD_RETRY, all_skipped_error, no_retry_hint
from sidecar.outcome import Outcome, UpstreamError, UpstreamTimeout
from sidecar.wire import send_closing

JSON_CONTENT_TYPE = "application/json"


class Failure(enum.Enum):
    """Why the sidecar answers itself: (error code, message or None for the default, close)."""

    OVERLOADED = (ErrorCode.OVERLOADED, None, False)
    """More than ``max_concurrent_requests`` in flight."""
    NOT_A_PATH = (
        ErrorCode.BAD_REQUEST,
        "the request target must be a path: this is not a forward proxy",
        True,
    )
    """An absolute-form target (``GET http://evil.example/x``): never a forward proxy."""
    NO_HOST = (ErrorCode.BAD_REQUEST, "a Host header is required", True)
    """HTTP/1.0 without ``Host`` (aiohttp's parser refuses HTTP/1.1 without one)."""
    INVALID_HOST = (ErrorCode.BAD_REQUEST, "the Host header is not a host and port", True)
    """A ``Host`` that is not ``uri-host [ ":" port ]`` (RFC 9112 section 3.2: MUST 400)."""
    DOT_SEGMENTS = (
        ErrorCode.BAD_REQUEST,
        'the request path has "." or ".." segments that make its route depend on how '
        "they are resolved",
        False,
    )
    """A path whose dot segments, resolved one way or another, would be routed elsewhere
    than the path as sent (:mod:`sidecar.target`)."""
    BODY_TIMEOUT = (ErrorCode.BAD_REQUEST, "request body not received in time", True)
    """The body did not arrive within ``client_read_timeout_ms``."""
    BODY_TOO_LARGE = (ErrorCode.REQUEST_TOO_LARGE, None, True)
    """The body is over ``max_request_body_bytes``."""
    MODEL_NEEDED = (
        ErrorCode.BAD_REQUEST,
        'this path routes on the body\'s "model": send a JSON object with a string "model"',
        False,
    )
    """No route matches, a route at this path needed the body's ``model``, and the body
    has no string ``model`` to give (a JSON body whose model no route lists is a 404)."""
    NO_ROUTE = (ErrorCode.NO_ROUTE, None, False)
    """No route matches."""
    ALL_OPEN = (ErrorCode.CIRCUIT_OPEN, None, False)
    """Every candidate was skipped by its breaker; no upstream was contacted."""
    ALL_RATE_LIMITED = (ErrorCode.RATE_LIMITED, None, False)
    """As ``ALL_OPEN``, every skipped breaker having opened on rate limits (``http_429``)."""
    CONNECT_ERROR = (ErrorCode.UPSTREAM_UNAVAILABLE, None, False)
    """The last candidate tried could not be connected to."""
    BROKEN_RESPONSE = (ErrorCode.UPSTREAM_UNAVAILABLE, None, False)
    """The last candidate tried reset or sent a broken response before the commit point."""
    FIRST_BYTE_TIMEOUT = (ErrorCode.UPSTREAM_TIMEOUT, None, False)
    """The last candidate tried sent no first body chunk within ``first_byte_timeout_ms``."""
    DEADLINE = (ErrorCode.UPSTREAM_TIMEOUT, None, False)
    """``request_timeout_ms`` ran out while waiting for a response."""

    @property
    def code(self) -> ErrorCode:
        """The contract's error code for this failure."""
        code: ErrorCode = self.value[0]
        return code


class Refusal(enum.Enum):
    """A request refused at the HTTP layer, before it is taken as an API call: (status,
    plain-text message). Answered like the HTTP parser's own refusals (plain text, the
    connection closed), as ``HTTP/1.1`` whatever the request line said."""

    VERSION = (505, "HTTP version not supported: this server speaks HTTP/1.1\n")
    """An ``HTTP/2.0`` (or later) request line in HTTP/1 syntax (RFC 9110 section 15.6.6)."""
    CODING = (501, "transfer coding not implemented: only chunked is\n")
    """A request ``Transfer-Encoding`` other than ``chunked`` alone (``gzip, chunked``):
    RFC 9112 section 6.1, a server SHOULD answer 501 to a coding it does not understand."""


async def refuse(request: web.BaseRequest, refusal: Refusal) -> web.StreamResponse:
    """Answer ``request`` with ``refusal`` and close the connection (RFC 9112 section 2.3:
    the status line says ``HTTP/1.1``; section 9.6: ``Connection: close``)."""
    status, text = refusal.value
    answer = web.StreamResponse(status=status)
    answer.content_type = "text/plain"
    answer.charset = "utf-8"
    await send_closing(request, answer, text.encode())
    return answer


def upstream_failure(err: UpstreamError) -> Failure:
    """The failure kind of a transport failure before the commit point."""
    if isinstance(err, UpstreamTimeout):
        return Failure.FIRST_BYTE_TIMEOUT
    if err.outcome is Outcome.CONNECT_ERROR:
        return Failure.CONNECT_ERROR
    return Failure.BROKEN_RESPONSE


def deadline_failure(last_error: UpstreamError | None) -> Failure:
    """The failure when ``request_timeout_ms`` runs out before the commit point.

    Contract: while a transport failure is being retried, the answer is that
    failure (502), not a timeout; otherwise a timeout (504).
    """
    if last_error is None or isinstance(last_error, UpstreamTimeout):
        return Failure.DEADLINE
    return upstream_failure(last_error)


class ErrorAnswer(web.Response):
    """A :class:`web.Response` the sidecar made itself; :attr:`code` is its error ``code``
    (``circuit_open``...), which the access log reports as ``error``."""

    __slots__ = ("code",)

    def __init__(self, code: ErrorCode, body: bytes) -> None:
        super().__init__(status=code.status, body=body, content_type=JSON_CONTENT_TYPE)
        self.code: str = code.code


def error_answer(
    failure: Failure,
    path: str,
    attempts: int,
    *,
    retry_after: int | None = None,
    retry_hint: bool = False,
) -> ErrorAnswer:
    """The sidecar's own answer for ``failure`` on request ``path``.

    :param attempts: upstream attempts made so far (``x-sidecar-attempts``).
    :param retry_after: whole seconds for ``Retry-After`` (``circuit_open``, ``rate_limited``).
    :param retry_hint: ``server.client_retry_hint``: ``x-should-retry: false`` on the
        codes after which another try is futile (:data:`sidecar.judge.NO_RETRY_ERRORS`).
    """
    code, message, close = failure.value
    resp = ErrorAnswer(code, error_body(code, path, message))
    headers = resp.headers
    headers[SIDECAR_ERROR] = code.code
    headers[SIDECAR_ATTEMPTS] = str(attempts)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if no_retry_hint(
        enabled=retry_hint, own_error=code, failing_status=False, retried_or_fell_back=False
    ):
        headers[SHOULD_RETRY] = "false"
    if close:
        resp.force_close()
    return resp


def all_skipped(
    last_failures: Iterable[str | None],
    wait_s: float | None,
    path: str,
    attempts: int,
    retry_hint: bool,
) -> web.Response:
    """The answer when every candidate was skipped by its breaker (no upstream contacted).

    :param last_failures: each skipped candidate's breaker ``last_failure``.
    :param wait_s: seconds until the soonest probe (None: unknown, every half-open
        slot taken).

    429 ``rate_limited`` when every one opened on rate limits (``http_429``), else
    503 ``circuit_open`` (:func:`sidecar.judge.all_skipped_error`); ``Retry-After``
    is the whole seconds until the soonest probe, rounded up, at least 1.
    """
    code = all_skipped_error(last_failures)
    failure = Failure.ALL_OPEN if code is ErrorCode.CIRCUIT_OPEN else Failure.ALL_RATE_LIMITED
    retry_after = 1 if wait_s is None else max(1, math.ceil(wait_s))
    return error_answer(failure, path, attempts, retry_after=retry_after, retry_hint=retry_hint)

"""The access log: one JSON ``request`` line per proxied request (contract, "Logs").

With ``server.access_log`` on (the default), the proxy handler's end calls
:func:`emit` once per request it answered: a relayed answer or one of the
sidecar's own JSON answers, ``overloaded`` included. The line is logged on the
``sidecar.access`` logger, whose level is fixed at INFO so that it is written
whatever ``log_level`` is (the root logger's level never filters a record that
propagates to its handlers). Fields, in this order::

    route          the chosen route's name, or null when refused before a route was chosen
    method         the request method
    path           the request path, never the query string (some providers take keys there)
    status         the status the client got; 499 when it left before the answer ended
    upstream       the upstream whose answer was relayed, or null
    attempts       every upstream attempt made (as ``x-sidecar-attempts``)
    fallbacks      moves to a next candidate (as ``sidecar_fallbacks_total``)
    duration_ms    request received -> handler ended, milliseconds (3 decimals)
    first_byte_ms  request received -> first chunk of the relayed answer, or null
    outcome        ok | caller_error | upstream_error | circuit_open | rate_limited |
                   aborted | client_closed | rejected (:func:`outcome`)
    error          the sidecar's own error ``code``, or null
    upstream_error the cause of the last failed attempt (even when a later one
                   succeeded), or null: dns | refused | tls | proxy | reset |
                   connect_timeout | timeout | http_<status> | sse_error | empty_turn
                   (:mod:`sidecar.causes`)
    input_tokens, output_tokens, cache_read_tokens
                   the relayed answer's usage as its provider reported it
                   (:mod:`sidecar.usage`), each null when not reported
    hedge          only on a route with ``hedge_after_ms``: ``won`` (the hedge's answer
                   was relayed), ``lost``, ``not_sent``, or null when no hedge was due
                   (:mod:`sidecar.hedge`)

Never a header value, a query string or a body. Cost on the hot path: one dict,
written straight to the stdout handler when that is the line's only destination
(``sidecar serve``: :meth:`sidecar.logs.StdoutHandler.write_line`, no
``LogRecord``), else one record handed to the logger (no caller lookup, so a
handler added to ``sidecar.access`` or the root logger sees every line); nothing
at all when ``access_log = false``.
"""

from __future__ import annotations

import logging

from aiohttp import web

from sidecar import logs
from sidecar.config import ServerConfig
from sidecar.errors import ErrorCode
from sidecar.exchange import Exchange

ACCESS_LOGGER = logging.getLogger("sidecar.access")
"""The access log's logger; INFO whatever ``log_level`` is (see the module docstring)."""
ACCESS_LOGGER.setLevel(logging.INFO)

_OUTCOME_OF_ERROR = {
    "circuit_open": "circuit_open",
    "rate_limited": "rate_limited",  # issue #12's 429: every skipped breaker opened on 429s
    "upstream_unavailable": "upstream_error",
    "upstream_timeout": "upstream_error",
    "overloaded": "rejected",
    "no_route": "rejected",
    "request_too_large": "rejected",
    "bad_request": "rejected",
}
"""``outcome`` of each of the sidecar's own error codes (every :class:`ErrorCode` is here)."""


def outcome(status: int, error: str | None, aborted: bool, client_left: bool) -> str:
    """The line's ``outcome`` (contract, "Logs"; pure).

    :param status: the status sent (an upstream's relayed, or the sidecar's own).
    :param error: the sidecar's own error code, or None for a relayed answer.
    :param aborted: the relay cut the client mid-answer (upstream failure or idle).
    :param client_left: the client went away before its answer ended (the handler was
        cancelled, or a write to it failed).
    """
    if client_left:
        return "client_closed"
    if aborted:
        return "aborted"
    if error is not None:
        return _OUTCOME_OF_ERROR.get(error, "rejected")
    if status < 400:
        return "ok"
    return "caller_error" if status < 500 else "upstream_error"


def emit(ex: Exchange, request: web.BaseRequest) -> None:
    """Log the line of the request that ``ex`` describes, ending now (``ex.clock``).

    Call once, from the proxy handler's end, after ``ex.status`` and ``ex.error``
    are final (``ex.status`` is 499 when ``ex.client_left``).
    """
    first = ex.first_byte_s
    status = ex.status
    usage = ex.usage
    fields: dict[str, object] = {
        "route": ex.route or None,
        "method": request.method,
        "path": request.path,
        "status": status,
        "upstream": ex.upstream,
        "attempts": ex.attempts,
        "fallbacks": ex.fallbacks,
        "duration_ms": round((ex.clock.now() - ex.started) * 1000, 3),
        "first_byte_ms": None if first is None else round(first * 1000, 3),
        "outcome": outcome(status, ex.error, ex.aborted, ex.client_left),
        "error": ex.error,
        "upstream_error": ex.upstream_error,
        "input_tokens": None if usage is None else usage.input,
        "output_tokens": None if usage is None else usage.output,
        "cache_read_tokens": None if usage is None else usage.cache_read,
    }
    hedge = ex.hedge
    if hedge is not None:  # a hedging route's line
        fields["hedge"] = hedge or None
    _log(fields)


def refused(server: ServerConfig, request: web.BaseRequest, code: ErrorCode) -> None:
    """Log (when ``server.access_log``) the line of a request refused before it was
    admitted (``overloaded``): no route, no upstream, no attempt, ``duration_ms`` 0."""
    if server.access_log:
        error = code.code
        _log(
            {
                "route": None,
                "method": request.method,
                "path": request.path,
                "status": code.status,
                "upstream": None,
                "attempts": 0,
                "fallbacks": 0,
                "duration_ms": 0.0,
                "first_byte_ms": None,
                "outcome": _OUTCOME_OF_ERROR.get(error, "rejected"),
                "error": error,
                "upstream_error": None,
                "input_tokens": None,
                "output_tokens": None,
                "cache_read_tokens": None,
            }
        )


def _log(fields: dict[str, object]) -> None:
    logs.info_line(ACCESS_LOGGER, "request", fields)

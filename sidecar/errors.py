"""The sidecar's own error answers (pure): status, code and body shape.

Contract, "The proxy port": the OpenAI error shape
``{"error": {"message": ..., "type": <code>, "code": <code>}}``, or Anthropic's
``{"type": "error", "error": {"type": ..., "message": ...}}`` when the request
path is ``/v1/messages``, with Anthropic's own type for the status so each SDK
raises its usual exception. Messages never contain an upstream URL, key or body.
"""

from __future__ import annotations

import enum

import orjson


class ErrorCode(enum.Enum):
    """The sidecar's error codes with their HTTP status and default message."""

    CIRCUIT_OPEN = (503, "every candidate upstream is skipped: circuit breaker open")
    RATE_LIMITED = (
        429,
        "every candidate upstream is skipped: its breaker opened on rate limits; slow down",
    )
    UPSTREAM_UNAVAILABLE = (
        502,
        "upstream unavailable: connection failed or broke before a response",
    )
    UPSTREAM_TIMEOUT = (504, "upstream timed out before sending a response")
    OVERLOADED = (503, "too many requests in flight in the sidecar")
    NO_ROUTE = (404, "no route matches this request")
    REQUEST_TOO_LARGE = (413, "request body larger than server.max_request_body_bytes")
    BAD_REQUEST = (400, "bad request")

    @property
    def status(self) -> int:
        """The HTTP status of this error."""
        return self.value[0]

    @property
    def code(self) -> str:
        """The ``code`` string: the enum name in lower case (``circuit_open``)."""
        return self.name.lower()


_ANTHROPIC_TYPES = {
    503: "overloaded_error",
    502: "api_error",
    504: "api_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    400: "invalid_request_error",
}

ANTHROPIC_PATH = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """True for Anthropic Messages API paths (``/v1/messages`` and below)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_body(code: ErrorCode, path: str, message: str | None = None) -> bytes:
    """JSON bytes of the error answer for ``code`` on request ``path``."""
    text = message or code.value[1]
    if is_anthropic_path(path):
        return orjson.dumps(
            {"type": "error", "error": {"type": _ANTHROPIC_TYPES[code.status], "message": text}}
        )
    return orjson.dumps({"error": {"message": text, "type": code.code, "code": code.code}})

"""Providers' error answers, byte for byte: in-stream error events and context-window 400s.

Each shape copies the bytes real providers send (captured streams and bodies
published in public bug reports and test fixtures, and the providers' API
references), whitespace included, with deterministic ids:

- Anthropic streams ``message_start`` (compact JSON), then ``ping`` and
  ``error`` events whose JSON has a space after each ``:`` and ``,``
  (``{"type": "ping"}``), as the API does;
- OpenAI streams a role-only first chunk, then on a server failure
  ``data: {"error": {"message": ..., "type": "server_error"}}`` (Python-style
  spacing) and closes without ``data: [DONE]``;
- OpenRouter's keep-alive is the comment ``: OPENROUTER PROCESSING``;
- OpenAI's 400 bodies are pretty-printed with two-space indents and no final
  newline; Anthropic's are compact and end with ``request_id``.

:data:`SHAPES` names these error shapes for ``Fault(shape=...)``, which also takes
the whole turns of :mod:`sidecar.testing.turn_shapes` (reasoning, empty turns, cached usage).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from sidecar.testing.shapes import anthropic_message_start

__all__ = [
    "ANTHROPIC_CONTEXT_MESSAGE",
    "KEEPALIVE",
    "OPENAI_CONTEXT_MESSAGE",
    "OPENAI_SERVER_ERROR_MESSAGE",
    "SHAPES",
    "Shape",
    "anthropic_context_window_body",
    "anthropic_error_event",
    "anthropic_error_stream",
    "anthropic_ping",
    "anthropic_stream_head",
    "openai_context_window_body",
    "openai_error_event",
    "openai_error_stream",
    "openai_role_chunk",
    "render_shape",
]

KEEPALIVE = b": OPENROUTER PROCESSING\n\n"
"""An SSE comment line as OpenRouter sends it while the model has not answered yet."""

OPENAI_SERVER_ERROR_MESSAGE = (
    "The server had an error while processing your request. Sorry about that!"
)
OPENAI_CONTEXT_MESSAGE = (
    "This model's maximum context length is 128000 tokens. However, your messages "
    "resulted in 130532 tokens. Please reduce the length of the messages."
)
ANTHROPIC_CONTEXT_MESSAGE = "prompt is too long: 208310 tokens > 200000 maximum"

_CREATED = 1753357673  # a fixed ``created`` keeps the bytes reproducible


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _spaced(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def anthropic_stream_head(model: str, rid: str) -> bytes:
    """The ``message_start`` event that opens every Anthropic stream (compact JSON)."""
    return anthropic_message_start(model, rid)


def anthropic_ping() -> bytes:
    """``event: ping`` with ``{"type": "ping"}``."""
    return b'event: ping\ndata: {"type": "ping"}\n\n'


def anthropic_error_event(error_type: str, message: str) -> bytes:
    """``event: error`` with ``{"type": "error", "error": {"type": ..., "message": ...}}``."""
    doc = {"type": "error", "error": {"type": error_type, "message": message}}
    return b"event: error\ndata: " + _spaced(doc) + b"\n\n"


def anthropic_error_stream(
    model: str, rid: str, error_type: str = "overloaded_error", message: str = "Overloaded"
) -> list[bytes]:
    """``message_start``, ``ping``, then the error event: three events, then the end."""
    return [
        anthropic_stream_head(model, rid),
        anthropic_ping(),
        anthropic_error_event(error_type, message),
    ]


def openai_role_chunk(model: str, rid: str) -> bytes:
    """The role-only first ``chat.completion.chunk`` (``"content": ""``, ``"refusal": null``)."""
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": _CREATED,
        "model": model,
        "service_tier": "default",
        "system_fingerprint": "fp_51e1070cf2",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "", "refusal": None},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": None,
    }
    return b"data: " + _compact(chunk) + b"\n\n"


def openai_error_event(error_type: str, message: str) -> bytes:
    """``data: {"error": {"message": ..., "type": ...}}`` as OpenAI sends it mid-stream."""
    return b"data: " + _spaced({"error": {"message": message, "type": error_type}}) + b"\n\n"


def openai_error_stream(
    model: str,
    rid: str,
    error_type: str = "server_error",
    message: str = OPENAI_SERVER_ERROR_MESSAGE,
) -> list[bytes]:
    """The role-only chunk, then the error event; no ``data: [DONE]``."""
    return [openai_role_chunk(model, rid), openai_error_event(error_type, message)]


def openai_context_window_body(message: str = OPENAI_CONTEXT_MESSAGE) -> bytes:
    """OpenAI's 400 ``context_length_exceeded`` body, pretty-printed as the API sends it."""
    doc = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    return json.dumps(doc, indent=2).encode()


def anthropic_context_window_body(
    message: str = ANTHROPIC_CONTEXT_MESSAGE, request_id: str = "req_011CV5Jab6gR3ZNs9Sj6apiD"
) -> bytes:
    """Anthropic's 400 ``invalid_request_error`` "prompt is too long" body (compact)."""
    doc = {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": message},
        "request_id": request_id,
    }
    return _compact(doc)


class Shape(NamedTuple):
    """A named shape as the fake sends it: status, whether it streams, one write per item."""

    status: int
    sse: bool
    chunks: list[bytes]


def render_shape(name: str, model: str, rid: str) -> Shape:
    """The shape called ``name`` (one of :data:`SHAPES`) for ``model`` with id ``rid``.

    :raises KeyError: for an unknown name.
    """
    if name == "anthropic_overloaded":
        return Shape(200, True, anthropic_error_stream(model, "msg_" + rid))
    if name == "anthropic_api_error":
        return Shape(200, True, anthropic_error_stream(model, "msg_" + rid, "api_error"))
    if name == "anthropic_invalid_request":
        events = anthropic_error_stream(
            model, "msg_" + rid, "invalid_request_error", "Invalid request"
        )
        return Shape(200, True, events)
    if name == "openai_server_error":
        return Shape(200, True, openai_error_stream(model, "chatcmpl-" + rid))
    if name == "openai_invalid_request":
        events = openai_error_stream(
            model, "chatcmpl-" + rid, "invalid_request_error", "Invalid request"
        )
        return Shape(200, True, events)
    if name == "openai_context_window":
        return Shape(400, False, [openai_context_window_body()])
    if name == "anthropic_context_window":
        return Shape(400, False, [anthropic_context_window_body()])
    raise KeyError(name)


SHAPES: frozenset[str] = frozenset(
    {
        "anthropic_overloaded",
        "anthropic_api_error",
        "anthropic_invalid_request",
        "openai_server_error",
        "openai_invalid_request",
        "openai_context_window",
        "anthropic_context_window",
    }
)
"""Names accepted by ``Fault(shape=...)``: the stream shapes are 200 ``text/event-stream``
(one write per event), the ``*_context_window`` ones a 400 JSON body."""

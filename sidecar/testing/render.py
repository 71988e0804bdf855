"""Choosing the response body for a request and its fault: route dispatch, errors, gzip."""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any, NamedTuple

from . import error_shapes, shapes, turn_shapes
from .fault import ReceivedRequest

__all__ = ["Body", "anthropic_error", "bad_fault_body", "json_object", "openai_error", "render"]

JSON = "application/json"
SSE = "text/event-stream; charset=utf-8"

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_exceeded",
}


class Body(NamedTuple):
    """A response body as the fake sends it: one socket write per chunk."""

    content_type: str
    chunks: list[bytes]
    sse: bool
    """True: an event stream, sent with chunked encoding; else with Content-Length."""
    status: int | None = None
    """The status to send instead of the fault's (named shapes set their own)."""


def openai_error(status: int, message: str) -> bytes:
    """OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``."""
    etype = _OPENAI_ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    doc = {"error": {"message": message, "type": etype, "param": None, "code": etype}}
    return json.dumps(doc).encode()


def anthropic_error(status: int, message: str) -> bytes:
    """Anthropic's error shape ``{"type": "error", "error": {"type", "message"}}``."""
    etype = _ANTHROPIC_ERROR_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
    return json.dumps({"type": "error", "error": {"type": etype, "message": message}}).encode()


def json_object(body: bytes) -> dict[str, Any]:
    """The body parsed as a JSON object, or ``{}`` when it is not one."""
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def split(data: bytes, n: int) -> list[bytes]:
    """``data`` in ``n`` consecutive writes (at least 1, at most ``len(data)``; none if empty)."""
    return shapes.split_evenly(data, max(1, min(n, len(data)))) if data else []


def gzip_chunks(chunks: list[bytes]) -> list[bytes]:
    """One gzip stream over all chunks, sync-flushed per chunk (each decodable on arrival)."""
    comp = zlib.compressobj(wbits=31)
    out = [comp.compress(c) + comp.flush(zlib.Z_SYNC_FLUSH) for c in chunks]
    out[-1] += comp.flush()
    return out


def _echo(rec: ReceivedRequest) -> bytes:
    doc = {
        "method": rec.method,
        "path": rec.path,
        "query_string": rec.query_string,
        "headers": [[k, v] for k, v in rec.headers.items()],
        "body": rec.body.decode("utf-8", "replace"),
        "body_base64": base64.b64encode(rec.body).decode(),
    }
    return json.dumps(doc).encode()


def _include_usage(doc: dict[str, Any]) -> bool:
    """The request body asks ``"stream_options": {"include_usage": true}``."""
    opts = doc.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def _route(rec: ReceivedRequest) -> str:
    """``chat``, ``messages``, ``responses``, ``embeddings``, ``models`` or ``echo``."""
    path = rec.path
    if path.startswith("/echo/"):
        return "echo"
    if rec.method == "GET" and path.endswith("/models"):
        return "models"
    if rec.method == "POST":
        if path.endswith("/chat/completions"):
            return "chat"
        for name in ("messages", "responses", "embeddings"):
            if path.endswith("/" + name):
                return name
    return "echo"


def render(rec: ReceivedRequest, doc: dict[str, Any], models: list[str]) -> Body:
    """The body for ``rec`` under ``rec.fault``; ``doc`` is the parsed JSON request body.
    SSE bodies start with ``fault.keepalives`` keep-alive comments."""
    body = _render(rec, doc, models)
    if body.sse and rec.fault.keepalives:
        return body._replace(chunks=[error_shapes.KEEPALIVE] * rec.fault.keepalives + body.chunks)
    return body


def _render(rec: ReceivedRequest, doc: dict[str, Any], models: list[str]) -> Body:
    f = rec.fault
    if f.shape is not None:
        model, rid = rec.model or "fake-model", f"fake{rec.index:06d}"
        if f.shape in turn_shapes.SHAPES:
            usage = _include_usage(doc)
            shape = turn_shapes.render_shape(f.shape, model, rid, include_usage=usage)
        else:
            shape = error_shapes.render_shape(f.shape, model, rid)
        return Body(SSE if shape.sse else JSON, shape.chunks, shape.sse, shape.status)
    if f.empty_body or f.status in (204, 304) or rec.method == "HEAD":
        return Body(JSON, [], False)
    if f.body is not None:
        return Body(JSON, split(f.body, f.chunks), False)
    route = _route(rec)
    if f.status >= 400:
        make = anthropic_error if route == "messages" else openai_error
        return Body(
            JSON, split(make(f.status, f"fake upstream: status {f.status}"), f.chunks), False
        )
    model, rid = rec.model or "fake-model", f"fake{rec.index:06d}"
    pieces = shapes.split_text(f.text, f.chunks)
    if route == "chat" and rec.stream:
        events = shapes.chat_completion_stream(
            model, pieces, rid="chatcmpl-" + rid, include_usage=_include_usage(doc)
        )
        return Body(SSE, events, True)
    if route == "messages" and rec.stream:
        return Body(SSE, shapes.anthropic_stream(model, pieces, rid="msg_" + rid), True)
    if route == "responses" and rec.stream:
        return Body(SSE, shapes.responses_stream(model, pieces, rid="resp_" + rid), True)
    if route == "chat":
        body = shapes.chat_completion(model, pieces, rid="chatcmpl-" + rid)
    elif route == "messages":
        body = shapes.anthropic_message(model, pieces, rid="msg_" + rid)
    elif route == "responses":
        body = shapes.response_object(model, pieces, rid="resp_" + rid)
    elif route == "embeddings":
        inp = doc.get("input")
        n = len(inp) if isinstance(inp, list) and inp and not isinstance(inp[0], int) else 1
        b64 = doc.get("encoding_format") == "base64"
        body = shapes.embeddings(model, n, base64_floats=b64)
    elif route == "models" and "anthropic-version" in rec.headers:
        body = shapes.anthropic_models_list(models)  # the Anthropic SDK's shape
    elif route == "models":
        body = shapes.models_list(models)
    else:
        body = _echo(rec)
    return Body(JSON, split(body, f.chunks), False)


def bad_fault_body(message: str) -> Body:
    """The 400 answer to an unparsable ``x-fake-fault`` header."""
    return Body(JSON, [openai_error(400, message)], False)

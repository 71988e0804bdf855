"""Response bodies in the OpenAI and Anthropic wire shapes, as the fake upstream sends them.

Every function returns ``bytes`` ready to write (JSON documents) or a list of
``bytes`` (one Server-Sent Event per item, each ending in a blank line), so the
fake upstream can send them one write per item. Field names and nesting follow
the providers' public API references closely enough for the official SDKs to
parse them; the values (ids, token counts, the text) are deterministic fakes.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from typing import Any, AnyStr

__all__ = [
    "DEFAULT_WORDS",
    "anthropic_message",
    "anthropic_message_start",
    "anthropic_models_list",
    "anthropic_stream",
    "chat_completion",
    "chat_completion_stream",
    "embeddings",
    "models_list",
    "response_object",
    "responses_stream",
    "split_evenly",
    "split_text",
]

DEFAULT_WORDS = ("Hello", " from", " the", " fake", " upstream", ".")
"""The words of the default reply; content chunk ``i`` is ``DEFAULT_WORDS[i % 6]``."""


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _sse(obj: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + _dumps(obj) + b"\n\n"


def split_evenly(data: AnyStr, pieces: int) -> list[AnyStr]:
    """``data`` in ``pieces`` consecutive slices of near-equal length (joined: ``data``)."""
    size, extra = divmod(len(data), max(pieces, 1))
    out, start = [], 0
    for i in range(max(pieces, 0)):
        end = start + size + (1 if i < extra else 0)
        out.append(data[start:end])
        start = end
    return out


def split_text(text: str | None, pieces: int) -> list[str]:
    """``text`` in ``pieces`` parts; ``None``: ``DEFAULT_WORDS`` cycled. ``0``: ``[]``."""
    if text is None:
        return [DEFAULT_WORDS[i % len(DEFAULT_WORDS)] for i in range(max(pieces, 0))]
    return split_evenly(text, pieces)


def _chat_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
    }


def chat_completion(model: str, pieces: list[str], *, rid: str, prompt_tokens: int = 10) -> bytes:
    """An OpenAI ``chat.completion`` object whose message content is ``"".join(pieces)``."""
    message = {"role": "assistant", "content": "".join(pieces), "refusal": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
    return _dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
            "choices": [choice],
            "usage": _chat_usage(prompt_tokens, len(pieces)),
        }
    )


def chat_completion_stream(
    model: str, pieces: list[str], *, rid: str, include_usage: bool = False, prompt_tokens: int = 10
) -> list[bytes]:
    """OpenAI streaming events: ``data: {chat.completion.chunk}`` items, then ``data: [DONE]``.

    Order: one chunk with ``delta: {"role": "assistant", "content": ""}``, one chunk
    per piece (``delta: {"content": piece}``), a chunk with ``delta: {}`` and
    ``finish_reason: "stop"``, a usage chunk (``choices: []``) when
    ``include_usage`` (the request's ``stream_options.include_usage``), and
    ``data: [DONE]``. So there are ``len(pieces) + 3`` events (``+ 4`` with usage).
    """
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time())}
    head |= {"model": model, "system_fingerprint": None}
    usage: dict[str, Any] = {"usage": None} if include_usage else {}

    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [choice], **usage})

    events = [chunk({"role": "assistant", "content": ""}, None)]
    events += [chunk({"content": p}, None) for p in pieces]
    events.append(chunk({}, "stop"))
    if include_usage:
        events.append(
            _sse({**head, "choices": [], "usage": _chat_usage(prompt_tokens, len(pieces))})
        )
    events.append(b"data: [DONE]\n\n")
    return events


def embeddings(model: str, inputs: int, *, base64_floats: bool, dims: int = 8) -> bytes:
    """An OpenAI embeddings ``list`` with ``inputs`` vectors of ``dims`` floats.

    ``base64_floats``: encode each vector as base64 little-endian float32, as the
    API does for ``"encoding_format": "base64"`` (the ``openai`` SDK's default).
    """
    data = []
    for i in range(inputs):
        vec = [round(0.1 * (i + 1) + 0.01 * d, 4) for d in range(dims)]
        emb: Any = (
            base64.b64encode(struct.pack(f"<{dims}f", *vec)).decode() if base64_floats else vec
        )
        data.append({"object": "embedding", "index": i, "embedding": emb})
    usage = {"prompt_tokens": 2 * inputs, "total_tokens": 2 * inputs}
    return _dumps({"object": "list", "data": data, "model": model, "usage": usage})


def models_list(models: list[str]) -> bytes:
    """An OpenAI models ``list``."""
    data = [{"id": m, "object": "model", "created": 1700000000, "owned_by": "fake"} for m in models]
    return _dumps({"object": "list", "data": data})


def anthropic_models_list(models: list[str]) -> bytes:
    """An Anthropic models list page (``GET /v1/models`` with ``anthropic-version``)."""
    data = [
        {"type": "model", "id": m, "display_name": m, "created_at": "2025-01-01T00:00:00Z"}
        for m in models
    ]
    first, last = (models[0], models[-1]) if models else (None, None)
    return _dumps({"data": data, "has_more": False, "first_id": first, "last_id": last})


def _response(model: str, text: str | None, rid: str) -> dict[str, Any]:
    output = []
    if text is not None:  # None: the in-progress snapshot, no output yet
        output.append(_output_message(rid, text, "completed"))
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress" if text is None else "completed",
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": None if text is None else _responses_usage(),  # null until completed
    }


def _responses_usage() -> dict[str, Any]:
    return {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 15,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _output_message(rid: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_" + rid,
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [_output_text(text)],
    }


def response_object(model: str, pieces: list[str], *, rid: str) -> bytes:
    """A minimal OpenAI Responses API ``response`` object (one output_text message)."""
    return _dumps(_response(model, "".join(pieces), rid))


def responses_stream(model: str, pieces: list[str], *, rid: str) -> list[bytes]:
    """Responses API events for one text message: ``response.created``,
    ``response.output_item.added``, ``response.content_part.added``, one
    ``response.output_text.delta`` per piece, ``response.output_text.done``,
    ``response.content_part.done``, ``response.output_item.done``,
    ``response.completed`` (``len(pieces) + 7`` events). As in the API, the
    snapshot in ``response.created`` has ``"usage": null``; only
    ``response.completed`` carries the usage."""
    text, item_id = "".join(pieces), "msg_" + rid
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    bodies: list[dict[str, Any]] = [
        {"type": "response.created", "response": _response(model, None, rid)},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": _output_message(rid, None, "in_progress"),
        },
        {"type": "response.content_part.added", **where, "part": _output_text("")},
    ]
    bodies += [{"type": "response.output_text.delta", **where, "delta": p} for p in pieces]
    bodies += [
        {"type": "response.output_text.done", **where, "text": text},
        {"type": "response.content_part.done", **where, "part": _output_text(text)},
        {
            "type": "response.output_item.done",
            "output_index": 0,
            "item": _output_message(rid, text, "completed"),
        },
        {"type": "response.completed", "response": _response(model, text, rid)},
    ]
    return [_sse({**body, "sequence_number": n}, body["type"]) for n, body in enumerate(bodies)]


def anthropic_message(model: str, pieces: list[str], *, rid: str) -> bytes:
    """An Anthropic Messages API ``message`` object with one text block."""
    return _dumps(
        {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": "".join(pieces)}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": len(pieces)},
        }
    )


def anthropic_message_start(model: str, rid: str) -> bytes:
    """The ``message_start`` event that opens every Anthropic stream (compact JSON)."""
    start = {
        "type": "message_start",
        "message": {
            "id": rid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 1},
        },
    }
    return _sse(start, "message_start")


def anthropic_stream(model: str, pieces: list[str], *, rid: str) -> list[bytes]:
    """Anthropic streaming events, in order: ``message_start``, ``content_block_start``,
    one ``content_block_delta`` per piece, ``content_block_stop``, ``message_delta``,
    ``message_stop`` (``len(pieces) + 5`` events; no ``ping``)."""
    events = [
        anthropic_message_start(model, rid),
        _sse(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        ),
    ]
    for p in pieces:
        delta = {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": p},
        }
        events.append(_sse(delta, "content_block_delta"))
    events.append(_sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
    msg_delta = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": len(pieces)},
    }
    events.append(_sse(msg_delta, "message_delta"))
    events.append(_sse({"type": "message_stop"}, "message_stop"))
    return events

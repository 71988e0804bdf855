"""Whole turns byte for byte: reasoning streams, empty turns, usage with cached tokens.

Each shape is one function below, registered under its name in :data:`SHAPES`, so
``Fault(shape=NAME)`` sends it; :data:`EXPECTED_TOKENS` says, per name, the token
counts a meter must read from its bytes. Ids come from the fake's request index
(``fake000001`` for the first request), timestamps are fixed, the model is the
request's: the bytes are reproducible. Streams are sent one write per event, JSON
bodies in one write; all are status 200.

Where the bytes come from (field order, spacing, which fields are there):

- OpenAI chat completions: chunks as :func:`~sidecar.testing.error_shapes.openai_role_chunk`
  (``service_tier``, ``system_fingerprint``); ``"usage":null`` on every chunk and a
  last ``"choices":[]`` chunk with the usage only when the request asked
  ``stream_options.include_usage`` (API reference). Usage with
  ``prompt_tokens_details`` / ``completion_tokens_details`` and JSON bodies
  pretty-printed with two-space indents and a final newline, as captured bodies
  logged verbatim show them.
- DeepSeek (``deepseek-reasoner``): captured chunks, e.g.
  ``"delta":{"content":null,"reasoning_content":"Okay"}``, fingerprint
  ``fp_7e73fd9a08``, ids without a prefix; DeepSeek's usage adds
  ``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens``.
- OpenRouter: captured streams (``gen-...`` ids, ``provider`` before ``model``,
  ``"reasoning"`` + ``"reasoning_details"`` deltas with ``"content":""``,
  ``native_finish_reason``) ending with a usage chunk whose one choice has an empty
  delta. OpenRouter always sends it: its Usage Accounting page says
  ``stream_options.include_usage`` is deprecated and has no effect.
- Anthropic: captured Claude 4.5 streams. Compact JSON, ``model`` first in
  ``message_start``, a ``cache_creation`` breakdown and ``service_tier``; the API
  pads each event's JSON with spaces before its closing brace (fixed counts here);
  ``{"type": "ping"}`` after the first ``content_block_start``; ``message_delta``'s
  usage repeats the input and cache counts beside the final ``output_tokens``.
  Thinking blocks as a captured extended-thinking stream has them
  (``{"type":"thinking","thinking":"","signature":""}``, ``thinking_delta`` events,
  one ``signature_delta``). Empty turns have no content block at all (``"content":[]``),
  as reported in anthropic-sdk-typescript#459 and openllmetry#4361. JSON bodies:
  compact, no final newline.
- Responses API: a captured o4-mini reasoning stream (``event:`` lines,
  ``sequence_number`` right after ``type``, the snapshot's fields, ``"usage":null``
  until the end, ``obfuscation`` on deltas, ``service_tier`` ``"auto"`` then
  ``"default"``); ``response.failed`` as a captured gpt-5 failed stream (status
  ``failed``, ``output: []``, ``usage: null``) with the reference's error
  ``{"code": "server_error", "message": "The model failed to generate a response."}``;
  the ``error`` event in the reference's flat shape. JSON bodies pretty-printed with
  two-space indents, no final newline (captured bodies).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from .error_shapes import Shape, anthropic_ping

__all__ = ["EXPECTED_TOKENS", "SHAPES", "render_shape"]

_CREATED = 1756752811
_OPENAI_FP = "fp_51e1070cf2"
_DEEPSEEK_FP = "fp_7e73fd9a08"
_DONE = b"data: [DONE]\n\n"
_PADS = (13, 6, 0, 11, 4, 14, 2, 9, 7, 1, 12, 5, 3, 10, 8)
"""Spaces before the closing brace of Anthropic event ``n`` (``_PADS[n % 15]``)."""
_SIGNATURE = "ErUBCkYIBxgCIkBmYWtlIHNpZ25hdHVyZSBvZiB0aGUgZmFrZSB1cHN0cmVhbSB0aGlua2luZw=="
_FAILED = "The model failed to generate a response."
_ERROR = "The server had an error while processing your request. Sorry about that!"

_Build = Callable[[str, str, bool], Shape]
_BUILDERS: dict[str, _Build] = {}


def _shape(name: str) -> Callable[[_Build], _Build]:
    def register(build: _Build) -> _Build:
        _BUILDERS[name] = build
        return build

    return register


# -- bytes ------------------------------------------------------------------------


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _data(obj: Any) -> bytes:
    return b"data: " + _compact(obj) + b"\n\n"


def _event(name: str, obj: Any, pad: int = 0) -> bytes:
    body = _compact(obj)
    return b"event: " + name.encode() + b"\ndata: " + body[:-1] + b" " * pad + b"}\n\n"


def _sse(events: list[bytes]) -> Shape:
    return Shape(200, True, events)


def _json(body: bytes) -> Shape:
    return Shape(200, False, [body])


# -- OpenAI chat completions --------------------------------------------------------


def _openai_usage(prompt: int, cached: int, completion: int, reasoning: int = 0) -> Any:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _openai_stream(
    model: str, rid: str, pieces: list[str], finish: str, usage: Any, include_usage: bool
) -> list[bytes]:
    head: dict[str, Any] = {
        "id": "chatcmpl-" + rid,
        "object": "chat.completion.chunk",
        "created": _CREATED,
    }
    head |= {"model": model, "service_tier": "default", "system_fingerprint": _OPENAI_FP}
    tail = {"usage": None} if include_usage else {}

    def chunk(delta: Any, reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return _data({**head, "choices": [choice], **tail})

    events = [chunk({"role": "assistant", "content": "", "refusal": None})]
    events += [chunk({"content": p}) for p in pieces]
    events.append(chunk({}, finish))
    if include_usage:
        events.append(_data({**head, "choices": [], "usage": usage}))
    return [*events, _DONE]


def _openai_json(model: str, rid: str, text: str, finish: str, usage: Any) -> bytes:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": [],
    }
    doc = {
        "id": "chatcmpl-" + rid,
        "object": "chat.completion",
        "created": _CREATED,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": usage,
        "service_tier": "default",
        "system_fingerprint": _OPENAI_FP,
    }
    return json.dumps(doc, indent=2).encode() + b"\n"


@_shape("openai_reasoning_stream")
def _openai_reasoning_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """DeepSeek-R1: ``reasoning_content`` deltas (``"content":null``), then content."""
    head: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": _CREATED,
        "model": model,
    }
    head["system_fingerprint"] = _DEEPSEEK_FP
    tail = {"usage": None} if include_usage else {}

    def chunk(delta: Any, reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return _data({**head, "choices": [choice], **tail})

    thoughts = ["Okay", ", the user", " says hi.", " A short greeting back."]
    events = [chunk({"role": "assistant", "content": None, "reasoning_content": ""})]
    events += [chunk({"content": None, "reasoning_content": t}) for t in thoughts]
    events += [
        chunk({"content": t, "reasoning_content": None}) for t in ("Hello", "! How can I help?")
    ]
    events.append(chunk({"content": "", "reasoning_content": None}, "stop"))
    if include_usage:
        usage = {
            "prompt_tokens": 1317,
            "completion_tokens": 395,
            "total_tokens": 1712,
            "prompt_tokens_details": {"cached_tokens": 1024},
            "completion_tokens_details": {"reasoning_tokens": 352},
            "prompt_cache_hit_tokens": 1024,
            "prompt_cache_miss_tokens": 293,
        }
        events.append(_data({**head, "choices": [], "usage": usage}))
    return _sse([*events, _DONE])


@_shape("openrouter_reasoning_stream")
def _openrouter_reasoning_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """OpenRouter: ``reasoning`` deltas (``"content":""``), content, finish, usage (always)."""
    head: dict[str, Any] = {"id": f"gen-{_CREATED}-{rid}", "provider": "DeepInfra", "model": model}
    head |= {"object": "chat.completion.chunk", "created": _CREATED}

    def chunk(delta: Any, reason: str | None = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
        choice |= {"native_finish_reason": reason, "logprobs": None}
        return _data({**head, "choices": [choice], **extra})

    def said(content: str, reasoning: str | None) -> Any:
        details = [{"type": "reasoning.text", "text": reasoning, "format": "unknown", "index": 0}]
        return {
            "role": "assistant",
            "content": content,
            "reasoning": reasoning,
            "reasoning_details": details if reasoning is not None else [],
        }

    thoughts = ["The user", " greets me", "; reply", " briefly."]
    events = [chunk(said("", t)) for t in thoughts]
    events += [chunk(said(t, None)) for t in ("Hi", " there!")]
    events.append(chunk(said("", None), "stop"))
    usage = {
        "prompt_tokens": 2210,
        "completion_tokens": 478,
        "total_tokens": 2688,
        "cost": 0.0013752,
        "is_byok": False,
        "prompt_tokens_details": {"cached_tokens": 1536, "audio_tokens": 0},
        "cost_details": {
            "upstream_inference_cost": None,
            "upstream_inference_prompt_cost": 0.0004716,
            "upstream_inference_completions_cost": 0.0009036,
        },
        "completion_tokens_details": {"reasoning_tokens": 301, "image_tokens": 0},
    }
    events.append(chunk({"role": "assistant", "content": ""}, usage=usage))
    return _sse([*events, _DONE])


@_shape("openai_empty_stream")
def _openai_empty_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """Role chunk, ``"delta":{}`` with ``"finish_reason":"stop"``: no content at all."""
    usage = _openai_usage(prompt=1203, cached=1152, completion=1)
    return _sse(_openai_stream(model, rid, [], "stop", usage, include_usage))


@_shape("openai_length_empty_stream")
def _openai_length_empty_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """No content, ``"finish_reason":"length"``: the budget went to reasoning."""
    usage = _openai_usage(prompt=845, cached=768, completion=64, reasoning=64)
    return _sse(_openai_stream(model, rid, [], "length", usage, include_usage))


@_shape("openai_cached_stream")
def _openai_cached_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """A text stream whose usage (with ``include_usage``) has cached prompt tokens."""
    usage = _openai_usage(prompt=1789, cached=1664, completion=38)
    pieces = ["Cached", " prefix", " hit."]
    return _sse(_openai_stream(model, rid, pieces, "stop", usage, include_usage))


@_shape("openai_empty_json")
def _openai_empty_json(model: str, rid: str, include_usage: bool) -> Shape:
    """A ``chat.completion`` whose message content is ``""`` (``"finish_reason":"stop"``)."""
    usage = _openai_usage(prompt=1420, cached=1280, completion=2)
    return _json(_openai_json(model, rid, "", "stop", usage))


@_shape("openai_length_empty_json")
def _openai_length_empty_json(model: str, rid: str, include_usage: bool) -> Shape:
    """Content ``""`` with ``"finish_reason":"length"``: all of it reasoning."""
    usage = _openai_usage(prompt=988, cached=896, completion=128, reasoning=128)
    return _json(_openai_json(model, rid, "", "length", usage))


@_shape("openai_cached_json")
def _openai_cached_json(model: str, rid: str, include_usage: bool) -> Shape:
    """A ``chat.completion`` with text and cached prompt tokens."""
    usage = _openai_usage(prompt=2006, cached=1920, completion=57)
    return _json(_openai_json(model, rid, "Cached prefix hit.", "stop", usage))


# -- Anthropic ----------------------------------------------------------------------


class _Usage(NamedTuple):
    """Anthropic's counts: ``output`` is the final one, ``first_output`` message_start's."""

    input: int
    cache_write: int
    cache_read: int
    output: int
    first_output: int = 1

    def full(self, output: int) -> Any:
        return {
            "input_tokens": self.input,
            "cache_creation_input_tokens": self.cache_write,
            "cache_read_input_tokens": self.cache_read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": self.cache_write,
                "ephemeral_1h_input_tokens": 0,
            },
            "output_tokens": output,
            "service_tier": "standard",
        }

    def final(self) -> Any:
        return {
            "input_tokens": self.input,
            "cache_creation_input_tokens": self.cache_write,
            "cache_read_input_tokens": self.cache_read,
            "output_tokens": self.output,
        }


def _anthropic_message(model: str, rid: str, content: list[Any], stop: str | None) -> Any:
    return {
        "model": model,
        "id": "msg_" + rid,
        "type": "message",
        "role": "assistant",
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
    }


def _anthropic_stream(
    model: str, rid: str, blocks: list[tuple[str, list[str]]], stop: str, usage: _Usage
) -> list[bytes]:
    """``blocks``: ``("thinking" | "text", deltas)``; a thinking block ends with a
    ``signature_delta``. Every event but the ping is padded by :data:`_PADS`."""
    start = {**_anthropic_message(model, rid, [], None), "usage": usage.full(usage.first_output)}
    events: list[tuple[str, Any]] = [("message_start", {"type": "message_start", "message": start})]
    for i, (kind, deltas) in enumerate(blocks):
        empty = {"thinking": "", "signature": ""} if kind == "thinking" else {"text": ""}
        block = {
            "type": "content_block_start",
            "index": i,
            "content_block": {"type": kind, **empty},
        }
        events.append(("content_block_start", block))
        if i == 0:
            events.append(("ping", None))
        parts = [{"type": f"{kind}_delta", kind: d} for d in deltas]
        if kind == "thinking":
            parts.append({"type": "signature_delta", "signature": _SIGNATURE})
        for part in parts:
            delta = {"type": "content_block_delta", "index": i, "delta": part}
            events.append(("content_block_delta", delta))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    end = {"stop_reason": stop, "stop_sequence": None}
    events.append(
        ("message_delta", {"type": "message_delta", "delta": end, "usage": usage.final()})
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return [
        anthropic_ping() if name == "ping" else _event(name, obj, _PADS[n % len(_PADS)])
        for n, (name, obj) in enumerate(events)
    ]


def _anthropic_json(model: str, rid: str, content: list[Any], stop: str, usage: _Usage) -> bytes:
    doc = {**_anthropic_message(model, rid, content, stop), "usage": usage.full(usage.output)}
    return _compact(doc)


@_shape("anthropic_thinking_stream")
def _anthropic_thinking_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """Extended thinking: a thinking block (3 ``thinking_delta``, a ``signature_delta``),
    then a text block; cache reads and writes in ``message_start``."""
    thoughts = ["The user", " wants a greeting", ". Keep it short."]
    blocks = [("thinking", thoughts), ("text", ["Hello", "! How can I help today?"])]
    usage = _Usage(input=37, cache_write=1843, cache_read=12288, output=286, first_output=4)
    return _sse(_anthropic_stream(model, rid, blocks, "end_turn", usage))


@_shape("anthropic_empty_stream")
def _anthropic_empty_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """``message_start``, ``message_delta`` (``end_turn``, 3 output tokens), ``message_stop``."""
    usage = _Usage(input=19, cache_write=512, cache_read=4096, output=3)
    return _sse(_anthropic_stream(model, rid, [], "end_turn", usage))


@_shape("anthropic_max_tokens_empty_stream")
def _anthropic_max_tokens_empty_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """No content block, ``"stop_reason":"max_tokens"``."""
    usage = _Usage(input=23, cache_write=256, cache_read=6144, output=16)
    return _sse(_anthropic_stream(model, rid, [], "max_tokens", usage))


@_shape("anthropic_cached_stream")
def _anthropic_cached_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """A text stream with cache reads and writes in ``message_start``."""
    usage = _Usage(input=53, cache_write=1391, cache_read=10240, output=45, first_output=3)
    blocks = [("text", ["Cached", " prefix", " hit."])]
    return _sse(_anthropic_stream(model, rid, blocks, "end_turn", usage))


@_shape("anthropic_empty_json")
def _anthropic_empty_json(model: str, rid: str, include_usage: bool) -> Shape:
    """A ``message`` with ``"content":[]`` and ``"stop_reason":"end_turn"``."""
    usage = _Usage(input=17, cache_write=384, cache_read=2048, output=2)
    return _json(_anthropic_json(model, rid, [], "end_turn", usage))


@_shape("anthropic_max_tokens_empty_json")
def _anthropic_max_tokens_empty_json(model: str, rid: str, include_usage: bool) -> Shape:
    """A ``message`` with ``"content":[]`` and ``"stop_reason":"max_tokens"``."""
    usage = _Usage(input=29, cache_write=640, cache_read=8192, output=32)
    return _json(_anthropic_json(model, rid, [], "max_tokens", usage))


@_shape("anthropic_cached_json")
def _anthropic_cached_json(model: str, rid: str, include_usage: bool) -> Shape:
    """A ``message`` with one text block and cache reads and writes."""
    usage = _Usage(input=41, cache_write=1207, cache_read=9216, output=73)
    content = [{"type": "text", "text": "Cached prefix hit."}]
    return _json(_anthropic_json(model, rid, content, "end_turn", usage))


# -- Responses API -------------------------------------------------------------------


def _responses_usage(input: int, cached: int, output: int, reasoning: int = 0) -> Any:
    return {
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input + output,
    }


def _response(
    model: str,
    rid: str,
    status: str,
    *,
    output: list[Any] | None = None,
    usage: Any = None,
    reasoning: bool = False,
    error: Any = None,
    incomplete: Any = None,
    max_output_tokens: int | None = None,
) -> Any:
    """The response object, fields in the API's order (a captured o4-mini stream)."""
    return {
        "id": "resp_" + rid,
        "object": "response",
        "created_at": _CREATED,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": None,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": output or [],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "prompt_cache_key": None,
        "reasoning": {"effort": "low", "summary": "detailed"}
        if reasoning
        else {"effort": None, "summary": None},
        "safety_identifier": None,
        "service_tier": "default" if status in ("completed", "incomplete") else "auto",
        "store": True,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": "auto",
        "tools": [],
        "top_logprobs": 0,
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": {},
    }


def _obfuscation(k: int) -> str:
    return "Zq7fKx2mWb9Lp4Ht"[: 3 + (5 * k) % 11]


def _responses_stream(bodies: list[Any]) -> list[bytes]:
    """``event: <type>`` per body, ``sequence_number`` (0, 1, ...) right after ``type``."""
    events = []
    for n, body in enumerate(bodies):
        rest = {k: v for k, v in body.items() if k != "type"}
        events.append(_event(body["type"], {"type": body["type"], "sequence_number": n, **rest}))
    return events


def _lifecycle(model: str, rid: str, reasoning: bool = False) -> list[Any]:
    snapshot = _response(model, rid, "in_progress", reasoning=reasoning)
    return [
        {"type": "response.created", "response": snapshot},
        {"type": "response.in_progress", "response": snapshot},
    ]


def _output_text(text: str) -> Any:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _message_item(rid: str, status: str, text: str | None) -> Any:
    content = [] if text is None else [_output_text(text)]
    item = {"id": "msg_" + rid, "type": "message", "status": status, "content": content}
    return {**item, "role": "assistant"}


def _message_events(rid: str, index: int, pieces: list[str]) -> list[Any]:
    """A message item at ``index``: added, part added, one delta per piece, done events."""
    text = "".join(pieces)
    where = {"item_id": "msg_" + rid, "output_index": index, "content_index": 0}
    added = {"output_index": index, "item": _message_item(rid, "in_progress", None)}
    done = {"output_index": index, "item": _message_item(rid, "completed", text)}
    deltas = [
        {"type": "response.output_text.delta", **where, "delta": p, "logprobs": []} for p in pieces
    ]
    for k, delta in enumerate(deltas):
        delta["obfuscation"] = _obfuscation(k)
    return [
        {"type": "response.output_item.added", **added},
        {"type": "response.content_part.added", **where, "part": _output_text("")},
        *deltas,
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": _output_text(text)},
        {"type": "response.output_item.done", **done},
    ]


def _reasoning_events(rid: str, pieces: list[str]) -> list[Any]:
    """A reasoning item at index 0 with one summary part, one delta per piece."""
    item_id, text = "rs_" + rid, "".join(pieces)
    where = {"item_id": item_id, "output_index": 0, "summary_index": 0}
    summary = {"type": "summary_text", "text": text}
    added = {"output_index": 0, "item": {"id": item_id, "type": "reasoning", "summary": []}}
    done = {"output_index": 0, "item": {"id": item_id, "type": "reasoning", "summary": [summary]}}
    deltas = [
        {"type": "response.reasoning_summary_text.delta", **where, "delta": p} for p in pieces
    ]
    for k, delta in enumerate(deltas):
        delta["obfuscation"] = _obfuscation(k)
    return [
        {"type": "response.output_item.added", **added},
        {"type": "response.reasoning_summary_part.added", **where, "part": {**summary, "text": ""}},
        *deltas,
        {"type": "response.reasoning_summary_text.done", **where, "text": text},
        {"type": "response.reasoning_summary_part.done", **where, "part": summary},
        {"type": "response.output_item.done", **done},
    ]


def _responses_json(doc: Any) -> bytes:
    return json.dumps(doc, indent=2).encode()


@_shape("responses_reasoning_stream")
def _responses_reasoning_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """A reasoning item (4 summary deltas), then a message; usage in ``response.completed``."""
    thoughts = ["**Greeting", " the user**", "\n\nA short", " reply fits."]
    pieces = ["Hello", "! How can I", " help?"]
    summary = [{"type": "summary_text", "text": "".join(thoughts)}]
    output = [
        {"id": "rs_" + rid, "type": "reasoning", "summary": summary},
        _message_item(rid, "completed", "".join(pieces)),
    ]
    usage = _responses_usage(input=3182, cached=2944, output=241, reasoning=192)
    done = _response(model, rid, "completed", output=output, usage=usage, reasoning=True)
    bodies = [
        *_lifecycle(model, rid, reasoning=True),
        *_reasoning_events(rid, thoughts),
        *_message_events(rid, 1, pieces),
        {"type": "response.completed", "response": done},
    ]
    return _sse(_responses_stream(bodies))


@_shape("responses_failed_stream")
def _responses_failed_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """``response.created``, ``response.in_progress``, ``response.failed`` (no output,
    ``"usage":null`` as the API sends it)."""
    error = {"code": "server_error", "message": _FAILED}
    failed = _response(model, rid, "failed", error=error)
    bodies = [*_lifecycle(model, rid), {"type": "response.failed", "response": failed}]
    return _sse(_responses_stream(bodies))


@_shape("responses_error_event_stream")
def _responses_error_event_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """``response.created``, then ``event: error`` in the reference's flat shape
    (``sequence_number`` last, as the reference shows it); no usage."""
    error = {"type": "error", "code": "server_error", "message": _ERROR, "param": None}
    created = _responses_stream(_lifecycle(model, rid)[:1])
    return _sse([*created, _event("error", {**error, "sequence_number": 1})])


@_shape("responses_empty_stream")
def _responses_empty_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """``response.completed`` with ``"output":[]`` straight after the lifecycle events."""
    usage = _responses_usage(input=611, cached=512, output=2)
    done = _response(model, rid, "completed", usage=usage)
    bodies = [*_lifecycle(model, rid), {"type": "response.completed", "response": done}]
    return _sse(_responses_stream(bodies))


@_shape("responses_incomplete_empty_stream")
def _responses_incomplete_empty_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """``response.incomplete`` (``max_output_tokens``), ``"output":[]``: all of it reasoning."""
    usage = _responses_usage(input=933, cached=640, output=32, reasoning=32)
    incomplete = {"reason": "max_output_tokens"}
    done = _response(
        model, rid, "incomplete", usage=usage, incomplete=incomplete, max_output_tokens=32
    )
    bodies = [*_lifecycle(model, rid), {"type": "response.incomplete", "response": done}]
    return _sse(_responses_stream(bodies))


@_shape("responses_cached_stream")
def _responses_cached_stream(model: str, rid: str, include_usage: bool) -> Shape:
    """A text message; ``response.completed``'s usage has cached input tokens."""
    pieces = ["Cached", " prefix", " hit."]
    usage = _responses_usage(input=1290, cached=1216, output=44)
    output = [_message_item(rid, "completed", "".join(pieces))]
    done = _response(model, rid, "completed", output=output, usage=usage)
    bodies = [
        *_lifecycle(model, rid),
        *_message_events(rid, 0, pieces),
        {"type": "response.completed", "response": done},
    ]
    return _sse(_responses_stream(bodies))


@_shape("responses_empty_json")
def _responses_empty_json(model: str, rid: str, include_usage: bool) -> Shape:
    """A completed ``response`` with ``"output":[]``."""
    usage = _responses_usage(input=707, cached=576, output=3)
    return _json(_responses_json(_response(model, rid, "completed", usage=usage)))


@_shape("responses_incomplete_empty_json")
def _responses_incomplete_empty_json(model: str, rid: str, include_usage: bool) -> Shape:
    """An ``incomplete`` ``response`` (``max_output_tokens``) with ``"output":[]``."""
    usage = _responses_usage(input=1111, cached=1088, output=48, reasoning=48)
    incomplete = {"reason": "max_output_tokens"}
    doc = _response(
        model, rid, "incomplete", usage=usage, incomplete=incomplete, max_output_tokens=48
    )
    return _json(_responses_json(doc))


@_shape("responses_cached_json")
def _responses_cached_json(model: str, rid: str, include_usage: bool) -> Shape:
    """A completed ``response`` with one ``output_text`` message and cached input tokens."""
    usage = _responses_usage(input=1555, cached=1408, output=66)
    output = [_message_item(rid, "completed", "Cached prefix hit.")]
    return _json(_responses_json(_response(model, rid, "completed", output=output, usage=usage)))


# -- registry ------------------------------------------------------------------------

SHAPES: frozenset[str] = frozenset(_BUILDERS)
"""The names of the turn shapes (``Fault(shape=...)`` also takes
:data:`~sidecar.testing.error_shapes.SHAPES`). ``*_stream``: 200
``text/event-stream``, one write per event; ``*_json``: 200 JSON, one write."""


def render_shape(name: str, model: str, rid: str, *, include_usage: bool = False) -> Shape:
    """The turn shape ``name`` (one of :data:`SHAPES`) for ``model``, ids from ``rid``
    (``fake000001``: ``chatcmpl-fake000001``, ``msg_fake000001``, ``resp_fake000001``...).

    ``include_usage``: the request's ``stream_options.include_usage``; only the
    OpenAI-style chat streams look at it (OpenRouter sends usage regardless).

    :raises KeyError: for an unknown name.
    """
    return _BUILDERS[name](model, rid, include_usage)


EXPECTED_TOKENS: dict[str, dict[str, int]] = {
    "openai_reasoning_stream": {"input": 293, "output": 395, "cache_read": 1024},
    "openrouter_reasoning_stream": {"input": 674, "output": 478, "cache_read": 1536},
    "openai_empty_stream": {"input": 51, "output": 1, "cache_read": 1152},
    "openai_length_empty_stream": {"input": 77, "output": 64, "cache_read": 768},
    "openai_cached_stream": {"input": 125, "output": 38, "cache_read": 1664},
    "openai_empty_json": {"input": 140, "output": 2, "cache_read": 1280},
    "openai_length_empty_json": {"input": 92, "output": 128, "cache_read": 896},
    "openai_cached_json": {"input": 86, "output": 57, "cache_read": 1920},
    "anthropic_thinking_stream": {
        "input": 37,
        "output": 286,
        "cache_read": 12288,
        "cache_write": 1843,
    },
    "anthropic_empty_stream": {"input": 19, "output": 3, "cache_read": 4096, "cache_write": 512},
    "anthropic_max_tokens_empty_stream": {
        "input": 23,
        "output": 16,
        "cache_read": 6144,
        "cache_write": 256,
    },
    "anthropic_cached_stream": {
        "input": 53,
        "output": 45,
        "cache_read": 10240,
        "cache_write": 1391,
    },
    "anthropic_empty_json": {"input": 17, "output": 2, "cache_read": 2048, "cache_write": 384},
    "anthropic_max_tokens_empty_json": {
        "input": 29,
        "output": 32,
        "cache_read": 8192,
        "cache_write": 640,
    },
    "anthropic_cached_json": {"input": 41, "output": 73, "cache_read": 9216, "cache_write": 1207},
    "responses_reasoning_stream": {"input": 238, "output": 241, "cache_read": 2944},
    "responses_failed_stream": {},
    "responses_error_event_stream": {},
    "responses_empty_stream": {"input": 99, "output": 2, "cache_read": 512},
    "responses_incomplete_empty_stream": {"input": 293, "output": 32, "cache_read": 640},
    "responses_cached_stream": {"input": 74, "output": 44, "cache_read": 1216},
    "responses_empty_json": {"input": 131, "output": 3, "cache_read": 576},
    "responses_incomplete_empty_json": {"input": 23, "output": 48, "cache_read": 1088},
    "responses_cached_json": {"input": 147, "output": 66, "cache_read": 1408},
}
"""Per shape, the tokens a meter must read from its bytes, by kind (``input``,
``output``, ``cache_read``, ``cache_write``; only the kinds the shape reports).
OpenAI-style: input = ``prompt_tokens`` - ``cached_tokens``; Anthropic: the last
reported values (``message_delta``'s ``output_tokens``); Responses: input =
``input_tokens`` - ``cached_tokens``. Chat streams assume ``include_usage`` was
asked; ``responses_failed_stream`` reports ``"usage":null`` and
``responses_error_event_stream`` no usage, so both are ``{}``."""

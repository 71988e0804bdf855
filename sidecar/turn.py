"""Whether a whole JSON answer is an empty turn (pure, no IO).

Contract, "An empty turn is a failure": a model that ends its turn cleanly with
nothing in it (as a broken self-hosted model does) is judged a failure, unless the
caller's length limit ended it. For a JSON answer (not streamed) of at most
:data:`JSON_TURN_LIMIT_BYTES`:

- a chat completion (``"object": "chat.completion"``) is empty when none of its
  choices' ``message`` has a non-empty ``content``, ``refusal``,
  ``reasoning_content``, ``reasoning`` or ``tool_calls``, or a non-null
  ``function_call``;
- an Anthropic message (``"type": "message"``) when no content block carries text,
  thinking or a tool use;
- a Responses object (``"object": "response"``) when its ``output`` holds no text,
  refusal, reasoning or function call (any output item other than a ``message`` is
  reasoning or a tool call);
- a length cut is not empty: a choice's ``finish_reason`` ``length``, Anthropic's
  ``stop_reason`` ``max_tokens``, a Responses ``incomplete_details.reason`` of
  ``max_output_tokens``.

Anything else (embeddings, model lists, errors, unrecognised JSON) is not a turn.
``reasoning`` (OpenRouter's field) counts beside ``reasoning_content`` because the
contract's "reasoning is output" rule for streams names both.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["JSON_TURN_LIMIT_BYTES", "Turn", "json_turn"]

JSON_TURN_LIMIT_BYTES = 256 * 1024
"""A JSON answer is read whole before its commit point, and judged, up to this size."""


class Turn(enum.Enum):
    """What a JSON answer is, as a turn of a model."""

    OUTPUT = "output"
    """A turn with output (text, refusal, reasoning, a tool call)."""
    EMPTY = "empty"
    """A turn that ended cleanly with no output: an empty turn."""
    LENGTH_CUT = "length_cut"
    """A turn with no output that the caller's length limit ended: not empty."""
    NOT_A_TURN = "not_a_turn"
    """Not a model's turn (embeddings, lists, errors, unrecognised)."""


def json_turn(doc: Any) -> Turn:
    """Classify a parsed JSON answer (see the module docstring)."""
    if not isinstance(doc, dict):
        return Turn.NOT_A_TURN
    kind = doc.get("object")
    if kind == "chat.completion":
        return _chat(doc)
    if kind == "response":
        return _response(doc)
    if doc.get("type") == "message":
        return _anthropic(doc)
    return Turn.NOT_A_TURN


def _chat(doc: dict[str, Any]) -> Turn:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return Turn.NOT_A_TURN
    length = False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        if isinstance(message, dict) and (
            message.get("content")
            or message.get("refusal")
            or message.get("reasoning_content")
            or message.get("reasoning")
            or message.get("tool_calls")
            or message.get("function_call") is not None
        ):
            return Turn.OUTPUT
        length = length or choice.get("finish_reason") == "length"
    return Turn.LENGTH_CUT if length else Turn.EMPTY


_ANTHROPIC_OUTPUT = {"text": "text", "thinking": "thinking"}
_ANTHROPIC_ALWAYS = frozenset({"tool_use", "server_tool_use", "redacted_thinking", "mcp_tool_use"})


def _anthropic(doc: dict[str, Any]) -> Turn:
    content = doc.get("content")
    if not isinstance(content, list):
        return Turn.NOT_A_TURN
    for block in content:
        if not isinstance(block, dict):
            continue
        btype = block.get("type")
        if btype in _ANTHROPIC_ALWAYS:
            return Turn.OUTPUT
        field = _ANTHROPIC_OUTPUT.get(btype) if isinstance(btype, str) else None
        if field is not None and block.get(field):
            return Turn.OUTPUT
    return Turn.LENGTH_CUT if doc.get("stop_reason") == "max_tokens" else Turn.EMPTY


def _response(doc: dict[str, Any]) -> Turn:
    output = doc.get("output")
    if not isinstance(output, list):
        return Turn.NOT_A_TURN
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") != "message":
            return Turn.OUTPUT  # reasoning, a function call, another tool call
        parts = item.get("content")
        for part in parts if isinstance(parts, list) else ():
            if isinstance(part, dict) and (part.get("text") or part.get("refusal")):
                return Turn.OUTPUT
    details = doc.get("incomplete_details")
    if isinstance(details, dict) and details.get("reason") == "max_output_tokens":
        return Turn.LENGTH_CUT
    return Turn.EMPTY

"""sidecar.turn: which JSON answers are empty turns (contract, "An empty turn is a failure")."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from sidecar.testing import turn_shapes
from sidecar.turn import Turn, json_turn


def chat(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", **message},
                     "finish_reason": finish}],
    }  # fmt: skip


def anthropic(content: list[dict[str, Any]], stop: str = "end_turn") -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": content, "stop_reason": stop}


def response(output: list[dict[str, Any]], reason: str | None = None) -> dict[str, Any]:
    details = {"reason": reason} if reason else None
    return {"object": "response", "output": output, "incomplete_details": details}


def message(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": list(parts)}


E, OUT, L, NOT = Turn.EMPTY, Turn.OUTPUT, Turn.LENGTH_CUT, Turn.NOT_A_TURN

TABLE = [
    (chat({"content": ""}), E),
    (chat({"content": None, "refusal": None}), E),
    (chat({"content": None, "tool_calls": []}), E),
    (chat({"content": "Hi"}), OUT),
    (chat({"content": None, "refusal": "I can't"}), OUT),
    (chat({"content": "", "reasoning_content": "Hmm"}), OUT),
    (chat({"content": "", "reasoning": "Hmm"}), OUT),
    (chat({"content": None, "tool_calls": [{"id": "t", "type": "function"}]}), OUT),
    (chat({"content": None, "function_call": {"name": "f"}}), OUT),
    (chat({"content": ""}, finish="length"), L),
    ({"object": "chat.completion", "choices": []}, E),
    ({"object": "chat.completion"}, NOT),
    (anthropic([]), E),
    (anthropic([{"type": "text", "text": ""}]), E),
    (anthropic([{"type": "text", "text": "Hi"}]), OUT),
    (anthropic([{"type": "thinking", "thinking": "Hmm", "signature": "s"}]), OUT),
    (anthropic([{"type": "redacted_thinking", "data": "x"}]), OUT),
    (anthropic([{"type": "tool_use", "id": "t", "name": "f", "input": {}}]), OUT),
    (anthropic([], stop="max_tokens"), L),
    (response([]), E),
    (response([message()]), E),
    (response([message({"type": "output_text", "text": "", "annotations": []})]), E),
    (response([message({"type": "output_text", "text": "Hi", "annotations": []})]), OUT),
    (response([message({"type": "refusal", "refusal": "No"})]), OUT),
    (response([{"type": "reasoning", "summary": []}]), OUT),
    (response([{"type": "function_call", "name": "f", "arguments": "{}"}]), OUT),
    (response([], reason="max_output_tokens"), L),
    (response([], reason="content_filter"), E),
    ({"object": "list", "data": [{"object": "embedding"}]}, NOT),
    ({"error": {"message": "x"}}, NOT),
    ([1, 2], NOT),
    ("text", NOT),
]


@pytest.mark.parametrize(("doc", "expected"), TABLE)
def test_json_turn(doc: Any, expected: Turn) -> None:
    assert json_turn(doc) is expected


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ("openai_empty_json", E),
        ("anthropic_empty_json", E),
        ("responses_empty_json", E),
        ("openai_length_empty_json", L),
        ("anthropic_max_tokens_empty_json", L),
        ("responses_incomplete_empty_json", L),
        ("openai_cached_json", OUT),
        ("anthropic_cached_json", OUT),
        ("responses_cached_json", OUT),
    ],
)
def test_the_providers_own_bytes(shape: str, expected: Turn) -> None:
    """The fake's byte-exact provider answers (sidecar.testing.turn_shapes)."""
    body = b"".join(turn_shapes.render_shape(shape, "m", "r1").chunks)
    assert json_turn(orjson.loads(body)) is expected

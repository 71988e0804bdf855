"""sidecar.usage: the tokens each provider shape reports, read from its bytes however cut.

The expected counts are the fake's (``sidecar.testing.turn_shapes.EXPECTED_TOKENS``),
written there as literal numbers; contract, "Tokens are metered".
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.testing import shapes, turn_shapes
from sidecar.usage import KINDS, LINE_LIMIT_BYTES, Usage

STREAMS = sorted(n for n in turn_shapes.SHAPES if n.endswith("_stream"))
JSONS = sorted(n for n in turn_shapes.SHAPES if n.endswith("_json"))


def stream_bytes(name: str) -> bytes:
    return b"".join(turn_shapes.render_shape(name, "m", "r1", include_usage=True).chunks)


def read(chunks: list[bytes]) -> dict[str, int]:
    u = Usage()
    for chunk in chunks:
        u.feed(chunk)
    return {k: v for k, v in zip(KINDS, u.kinds(), strict=True) if v is not None}


def cut(data: bytes, points: list[int]) -> list[bytes]:
    edges = [0, *sorted(p % (len(data) + 1) for p in points), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("name", STREAMS)
def test_each_stream_shape_one_write_per_event(name: str) -> None:
    events = turn_shapes.render_shape(name, "m", "r1", include_usage=True).chunks
    assert read(events) == turn_shapes.EXPECTED_TOKENS[name]


@pytest.mark.parametrize("name", JSONS)
def test_each_json_shape(name: str) -> None:
    u = Usage()
    u.take(orjson.loads(b"".join(turn_shapes.render_shape(name, "m", "r1").chunks)))
    got = {k: v for k, v in zip(KINDS, u.kinds(), strict=True) if v is not None}
    assert got == turn_shapes.EXPECTED_TOKENS[name]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(STREAMS), st.lists(st.integers(min_value=0), max_size=40))
def test_any_cut_of_a_stream_reads_the_same_usage(name: str, points: list[int]) -> None:
    data = stream_bytes(name)
    assert read(cut(data, points)) == turn_shapes.EXPECTED_TOKENS[name]


def test_one_byte_at_a_time() -> None:
    for name in STREAMS:
        data = stream_bytes(name)
        assert (
            read([data[i : i + 1] for i in range(len(data))]) == turn_shapes.EXPECTED_TOKENS[name]
        )


def test_only_the_events_that_hold_a_usage_object_are_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OpenAI's chunks all carry ``"usage":null`` when usage was asked: none is parsed
    but the last one's."""
    parsed: list[bytes] = []
    real = orjson.loads

    def counting(data: Any) -> Any:
        parsed.append(bytes(data))
        return real(data)

    monkeypatch.setattr(orjson, "loads", counting)  # the module sidecar.usage calls
    events = shapes.chat_completion_stream("m", ["a", "b", "c"], rid="c1", include_usage=True)
    assert sum(b'"usage":null' in e for e in events) == 5
    assert read(events) == {"input": 10, "output": 3}
    assert len(parsed) == 1 and b'"choices":[]' in parsed[0]


@pytest.mark.parametrize(
    "chunk",
    [
        b'data: {"content": "\\"usage\\": {"}\n\n',  # the key inside a string: escaped
        b'data: ["usage"]\n\n',  # a string value, not a key
        b'data: {"usage": {"prompt_tokens": "many"}}\n\n',  # not an integer
        b'data: {"usage": {"prompt_tokens": -1}}\n\n',
        b'data: {"usage": {broken\n\n',
        b': "usage": {"prompt_tokens": 3}\n\n',  # a comment, not data
        b'event: x\nid: "usage": {"input_tokens": 3}\n\n',
    ],
)
def test_what_cannot_be_read_is_ignored(chunk: bytes) -> None:
    assert read([chunk]) == {}


def test_a_later_report_replaces_an_earlier_one() -> None:
    """Anthropic: message_start's output_tokens (1) then message_delta's final count."""
    events = shapes.anthropic_stream("m", ["a", "b"], rid="msg_1")
    assert read(events) == {"input": 10, "output": 2}


def test_a_line_longer_than_the_limit_is_dropped_and_the_next_one_read() -> None:
    big = b'data: {"pad": "' + b"x" * LINE_LIMIT_BYTES + b'", "usage": {"prompt_tokens": 9}}\n'
    tail = b'data: {"usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\n'
    pieces = [big[i : i + 65536] for i in range(0, len(big), 65536)]
    assert read([*pieces, tail]) == {"input": 4, "output": 2}
    u = Usage()
    for p in cut(big[:-1], list(range(0, len(big), 65536))):
        u.feed(p)  # the whole line but its end: past the limit, nothing of it is kept
    assert u._pending == [] and u._pending_size > LINE_LIMIT_BYTES


def test_reported() -> None:
    u = Usage()
    assert not u.reported
    u.take({"usage": {"output_tokens": 0}})
    assert u.reported and u.kinds() == (None, 0, None, None)

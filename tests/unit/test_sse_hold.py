"""sidecar.sse_hold: which events are held, what commits, what is an error event.

Tables of real provider streams (the fake upstream's byte-exact shapes) and
hand-made edge cases; Hypothesis checks that any cut of a stream into chunks
gives the same decision and, overall, the same bytes.
"""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from sidecar.sse_hold import HOLD, HOLD_LIMIT_BYTES, Decision, SseHold, Verdict, holds_events
from sidecar.testing import error_shapes, shapes

COMMIT, PROVIDER, CALLER = Verdict.COMMIT, Verdict.PROVIDER_ERROR, Verdict.CALLER_ERROR
EMPTY = Verdict.EMPTY


def run(chunks: list[bytes]) -> tuple[Decision, int, bytes]:
    """Feed ``chunks`` until a decision (else finish): (decision, index of the deciding
    chunk or len(chunks) for finish, the bytes after it)."""
    hold = SseHold()
    for i, chunk in enumerate(chunks):
        d = hold.feed(chunk)
        if d is not HOLD:
            assert d.verdict is not Verdict.HOLD
            return d, i, b"".join(chunks[i + 1 :])
        assert d.data == b""
    return hold.finish(), len(chunks), b""


def data_event(obj: object, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_chunk(delta: dict[str, object], **extra: object) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return data_event({"id": "c1", "object": "chat.completion.chunk", "choices": [choice], **extra})


ROLE = error_shapes.openai_role_chunk("gpt-4o", "chatcmpl-1")
PING = error_shapes.anthropic_ping()
START = error_shapes.anthropic_stream_head("claude", "msg_1")
CONTENT = chat_chunk({"content": "Hi"})
KEEP = error_shapes.KEEPALIVE


# -- real provider streams, one write per event --------------------------------------


def test_anthropic_stream_commits_at_the_first_delta_with_every_held_byte() -> None:
    events = shapes.anthropic_stream("claude", ["Hello", " world"], rid="msg_1")
    d, i, rest = run(events)
    assert (d.verdict, d.reason, i) == (COMMIT, "output", 2)
    assert d.data == b"".join(events[:3])  # message_start, content_block_start, delta
    assert d.data + rest == b"".join(events)


def test_openai_stream_holds_the_role_only_chunk() -> None:
    events = shapes.chat_completion_stream("gpt-4o", ["Hello"], rid="c1")
    d, i, _ = run(events)
    assert (d.verdict, d.reason, i) == (COMMIT, "output", 1)
    assert d.data == events[0] + events[1]


def test_keepalive_comments_are_held_then_committed_with_the_output() -> None:
    events = [KEEP, KEEP, ROLE, CONTENT]
    d, i, _ = run(events)
    assert (d.verdict, i, d.data) == (COMMIT, 3, b"".join(events))


@pytest.mark.parametrize(
    ("shape", "verdict", "reason"),
    [
        ("anthropic_overloaded", PROVIDER, "overloaded_error"),
        ("anthropic_api_error", PROVIDER, "api_error"),
        ("openai_server_error", PROVIDER, "server_error"),
        ("anthropic_invalid_request", CALLER, "invalid_request_error"),
        ("openai_invalid_request", CALLER, "invalid_request_error"),
    ],
)
def test_error_shapes_before_output(shape: str, verdict: Verdict, reason: str) -> None:
    s = error_shapes.render_shape(shape, "m", "r1")
    d, i, rest = run([KEEP, *s.chunks])
    assert (d.verdict, d.reason, i, rest) == (verdict, reason, len(s.chunks), b"")
    assert d.data == KEEP + b"".join(s.chunks)


# -- which events carry output -------------------------------------------------------

HELD = [
    pytest.param(b": comment\n\n", id="comment"),
    pytest.param(b":\n\n", id="empty-comment"),
    pytest.param(START, id="message_start"),
    pytest.param(
        data_event({"type": "content_block_start", "index": 0}, "content_block_start"),
        id="content_block_start",
    ),
    pytest.param(
        data_event(
            {"type": "content_block_start", "content_block": {"type": "tool_use"}},
            "content_block_start",
        ),
        id="tool_use-block-start",
    ),
    pytest.param(PING, id="ping"),
    pytest.param(b'data: {"type":"ping"}\n\n', id="unnamed-ping"),
    pytest.param(b'data:{"type": "ping"}\n\n', id="no-space-after-colon"),
    pytest.param(b"event: ping\n\n", id="event-without-data"),
    pytest.param(b"id: 7\nretry: 100\n\n", id="id-and-retry-only"),
    pytest.param(ROLE, id="role-only-chunk"),
    pytest.param(chat_chunk({"content": None}), id="content-null"),
    pytest.param(chat_chunk({"tool_calls": []}), id="tool_calls-empty"),
    pytest.param(chat_chunk({"function_call": None}), id="function_call-null"),
    pytest.param(chat_chunk({"refusal": ""}), id="refusal-empty"),
    pytest.param(chat_chunk({}), id="empty-delta"),
    pytest.param(data_event({"choices": [], "usage": {"total_tokens": 3}}), id="usage-chunk"),
    pytest.param(chat_chunk({"content": ""}, error=None), id="error-null"),
    pytest.param(chat_chunk({"reasoning_content": ""}), id="reasoning_content-empty"),
    pytest.param(chat_chunk({"reasoning": None}), id="reasoning-null"),
    pytest.param(
        data_event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        id="content_block_stop",
    ),
    pytest.param(
        data_event(
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, "message_delta"
        ),
        id="message_delta",
    ),
    *(
        pytest.param(data_event({"type": name, "sequence_number": 0}, name), id=name)
        for name in (
            "response.created",
            "response.queued",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_summary_part.added",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.reasoning_summary_text.done",
        )
    ),
    pytest.param(
        data_event({"type": "response.in_progress", "sequence_number": 1}),
        id="responses-event-named-by-type-only",
    ),
]


@pytest.mark.parametrize("event", HELD)
def test_events_without_output_are_held(event: bytes) -> None:
    """Contract: events without output are held; a stream that ends with nothing but
    them is an empty turn."""
    hold = SseHold()
    assert hold.feed(event) is HOLD
    d = hold.finish()
    assert (d.verdict, d.reason, d.data) == (EMPTY, "empty", event)


TURN_ENDS = [
    pytest.param(b"data: [DONE]\n\n", id="done"),
    pytest.param(data_event({"type": "message_stop"}, "message_stop"), id="message_stop"),
    pytest.param(
        data_event(
            {"type": "response.completed", "response": {"output": []}}, "response.completed"
        ),
        id="response.completed",
    ),
    pytest.param(
        data_event(
            {"type": "response.incomplete",
             "response": {"incomplete_details": {"reason": "content_filter"}}},
            "response.incomplete",
        ),
        id="response.incomplete-not-for-length",
    ),
]  # fmt: skip


@pytest.mark.parametrize("event", TURN_ENDS)
def test_a_turn_that_ends_with_no_output_is_empty_at_its_end_event(event: bytes) -> None:
    d, i, rest = run([KEEP, ROLE, event, CONTENT])
    assert (d.verdict, d.reason, i, rest) == (EMPTY, "empty", 2, CONTENT)
    assert d.data == KEEP + ROLE + event


LENGTH_CUTS = [
    pytest.param(
        [ROLE, data_event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
         data_event({"choices": [], "usage": {"completion_tokens": 0}}), b"data: [DONE]\n\n"],
        id="openai-finish_reason-length",
    ),
    pytest.param(
        [START,
         data_event({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}},
                    "message_delta"),
         data_event({"type": "message_stop"}, "message_stop")],
        id="anthropic-max_tokens",
    ),
    pytest.param(
        [data_event({"type": "response.created"}, "response.created"),
         data_event({"type": "response.incomplete",
                     "response": {"incomplete_details": {"reason": "max_output_tokens"}}},
                    "response.incomplete")],
        id="responses-max_output_tokens",
    ),
    pytest.param(
        [ROLE, data_event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})],
        id="openai-length-then-the-end-of-the-body",
    ),
]  # fmt: skip


@pytest.mark.parametrize("events", LENGTH_CUTS)
def test_a_turn_cut_by_the_callers_length_limit_is_not_empty(events: list[bytes]) -> None:
    """Contract: a length cut is not empty; it commits with what it holds."""
    d, _, rest = run(events)
    assert (d.verdict, d.reason) == (COMMIT, "length")
    assert d.data + rest == b"".join(events)


OUTPUT = [
    pytest.param(CONTENT, id="content"),
    pytest.param(chat_chunk({"refusal": "no"}), id="refusal"),
    pytest.param(chat_chunk({"tool_calls": [{"index": 0, "id": "t"}]}), id="tool_calls"),
    pytest.param(chat_chunk({"function_call": {"name": "f"}}), id="function_call"),
    pytest.param(
        data_event({"choices": [{"delta": {}}, {"index": 1, "delta": {"content": "x"}}]}),
        id="second-choice",
    ),
    pytest.param(data_event({"choices": [{"index": 0, "text": "Hi"}]}), id="legacy-text"),
    pytest.param(
        data_event({"type": "content_block_delta", "delta": {"text": "x"}}, "content_block_delta"),
        id="content_block_delta",
    ),
    pytest.param(chat_chunk({"reasoning_content": "Hmm"}), id="reasoning_content"),
    pytest.param(chat_chunk({"reasoning": "Hmm", "content": ""}), id="openrouter-reasoning"),
    pytest.param(
        data_event(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "thinking_delta", "thinking": "Let me"},
            },
            "content_block_delta",
        ),
        id="anthropic-thinking_delta",
    ),
    *(
        pytest.param(data_event({"type": name, "delta": "x"}, name), id=name)
        for name in (
            "response.output_text.delta",
            "response.reasoning_summary_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
            "response.refusal.delta",
        )
    ),
    pytest.param(
        data_event(
            {"type": "response.web_search_call.in_progress"}, "response.web_search_call.in_progress"
        ),
        id="other-responses-event",
    ),
    pytest.param(b"data: hello\n\n", id="plain-text"),
    pytest.param(b"data\n\n", id="field-without-colon"),
    pytest.param(b'data: {"type": "ping"}\x1c\n\n', id="x1c-is-not-a-line-end"),
    pytest.param(b'data: {"type": "ping"}\x0b\x0c\x85\n\n', id="vt-ff-nel-are-not-line-ends"),
    pytest.param(b'data: {"choices":\ndata: [{"delta": {"content": "x"}}]}\n\n', id="multiline"),
]


@pytest.mark.parametrize("event", OUTPUT)
def test_events_with_output_commit(event: bytes) -> None:
    d, i, _ = run([KEEP, ROLE, event, CONTENT])
    assert (d.verdict, d.reason, i) == (COMMIT, "output", 2)
    assert d.data == KEEP + ROLE + event


# -- error events --------------------------------------------------------------------

ERRORS = [
    (data_event({"type": "error", "error": {"type": "rate_limit_error", "message": "x"}}, "error"),
     PROVIDER, "rate_limit_error"),
    (b"event: error\ndata: not json\n\n", PROVIDER, "unrecognised"),
    (b"event: error\ndata: {}\n\n", PROVIDER, "unrecognised"),
    (data_event({"type": "error", "error": {"type": "weird_error"}}, "error"),
     PROVIDER, "weird_error"),
    (data_event({"error": "boom"}), PROVIDER, "unrecognised"),
    # OpenRouter: the type is in error.code, string or number, beside empty choices
    (data_event({"id": "gen-1", "object": "chat.completion.chunk",
                 "error": {"code": "server_error", "message": "Provider disconnected"},
                 "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]}),
     PROVIDER, "server_error"),
    (data_event({"error": {"code": 502, "message": "Error processing stream"}}),
     PROVIDER, "unrecognised"),
    # vLLM: {"error": {"object": "error", "type": "BadRequestError", "code": 400}}
    (data_event({"error": {"object": "error", "message": "x", "type": "BadRequestError",
                           "param": None, "code": 400}}),
     PROVIDER, "BadRequestError"),
    (data_event({"error": {"message": "x", "type": "invalid_request_error",
                           "code": "context_length_exceeded"}}),
     CALLER, "invalid_request_error"),
    (data_event({"error": {"message": "x", "type": None, "code": "invalid_request_error"}}),
     CALLER, "invalid_request_error"),
    (data_event({"error": {"type": "BadRequestError", "code": "not_found_error"}}),
     CALLER, "not_found_error"),
    # The Responses API: response.failed (its error at response.error) and its error event
    (data_event({"type": "response.failed", "sequence_number": 2,
                 "response": {"status": "failed",
                              "error": {"code": "server_error", "message": "x"}}},
                "response.failed"),
     PROVIDER, "server_error"),
    (data_event({"type": "response.failed", "response": {"status": "failed", "error": None}},
                "response.failed"),
     PROVIDER, "unrecognised"),
    (data_event({"type": "response.failed",
                 "response": {"error": {"code": "invalid_prompt", "message": "x"}}},
                "response.failed"),
     CALLER, "invalid_prompt"),
    (data_event({"type": "error", "code": "rate_limit_exceeded", "message": "x", "param": None,
                 "sequence_number": 1}, "error"),
     PROVIDER, "rate_limit_exceeded"),
    (data_event({"type": "error", "code": "invalid_prompt", "message": "x", "param": None},
                "error"),
     CALLER, "invalid_prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("event", "verdict", "reason"), ERRORS)
def test_error_events(event: bytes, verdict: Verdict, reason: str) -> None:
    d, i, _ = run([START, PING, event, CONTENT])
    assert (d.verdict, d.reason, i, d.data) == (verdict, reason, 2, START + PING + event)


@pytest.mark.parametrize(
    "kind",
    [
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "invalid_prompt",
    ],
)
def test_every_caller_error_type_is_the_callers(kind: str) -> None:
    d, _, _ = run([error_shapes.anthropic_error_event(kind, "m")])
    assert (d.verdict, d.reason) == (CALLER, kind)
    d, _, _ = run([error_shapes.openai_error_event(kind, "m")])
    assert (d.verdict, d.reason) == (CALLER, kind)


def test_an_error_after_output_is_not_judged() -> None:
    events = [ROLE, CONTENT, error_shapes.openai_error_event("server_error", "late")]
    d, i, rest = run(events)
    assert (d.verdict, i, rest) == (COMMIT, 1, events[2])


# -- framing -------------------------------------------------------------------------


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_line_endings(eol: bytes) -> None:
    raw = b"".join(error_shapes.render_shape("anthropic_overloaded", "m", "r").chunks)
    stream = raw.replace(b"\n", eol)
    d, _, _ = run([stream])
    assert (d.verdict, d.reason, d.data) == (PROVIDER, "overloaded_error", stream)


def test_crlf_cut_between_cr_and_lf_is_one_line_end() -> None:
    # "\r" | "\n\r\n": the LF completes the CRLF, it is not a blank line
    d, i, rest = run([b": x\r", b"\ndata: [DONE]\r", b"\n\r\n"])
    assert (d.verdict, i, d.data, rest) == (EMPTY, 2, b": x\r\ndata: [DONE]\r\n\r\n", b"")


def test_cr_ended_event_decides_at_the_cr() -> None:
    d, i, rest = run([b"data: [DONE]\r\r", b"\n"])
    assert (d.verdict, i, rest) == (EMPTY, 0, b"\n")


def test_a_leading_bom_is_ignored_even_when_cut() -> None:
    d, i, _ = run([b"\xef", b"\xbb", b"\xbfevent: ping\n", b"data: {}\n\n", CONTENT])
    assert (d.verdict, i) == (COMMIT, 4)
    assert d.data.startswith(b"\xef\xbb\xbfevent: ping")


def test_a_bom_only_body() -> None:
    d, _, _ = run([b"\xef\xbb"])
    assert (d.verdict, d.reason, d.data) == (EMPTY, "empty", b"\xef\xbb")


def test_empty_body_commits_with_nothing() -> None:
    d, _, _ = run([])
    assert (d.verdict, d.reason, d.data) == (COMMIT, "end", b"")


def test_unterminated_error_event_at_the_end_is_still_an_error() -> None:
    d, _, _ = run([ROLE, b'data: {"error": {"type": "server_error"}}'])
    assert (d.verdict, d.reason) == (PROVIDER, "server_error")
    d, _, _ = run([ROLE, b'data: {"error": {"type": "server_error"}}\n'])
    assert (d.verdict, d.reason) == (PROVIDER, "server_error")


def test_unterminated_held_event_at_the_end_is_an_empty_turn() -> None:
    d, _, _ = run([ROLE, b"event: ping\ndata: {}"])
    assert (d.verdict, d.reason, d.data) == (EMPTY, "empty", ROLE + b"event: ping\ndata: {}")


def test_no_feed_after_a_decision() -> None:
    hold = SseHold()
    assert hold.feed(CONTENT).verdict is COMMIT
    with pytest.raises(RuntimeError):
        hold.feed(CONTENT)
    with pytest.raises(RuntimeError):
        hold.finish()


# -- the 64 KiB limit ----------------------------------------------------------------


def comments(total: int) -> bytes:
    """SSE comment lines of exactly ``total`` bytes (``total >= 2``)."""
    body = b":" + b"x" * (total - 2) + b"\n"
    return body


def test_more_than_the_limit_held_commits() -> None:
    pad = comments(HOLD_LIMIT_BYTES)
    hold = SseHold()
    assert hold.feed(pad) is HOLD
    assert hold.held_bytes == HOLD_LIMIT_BYTES
    d = hold.feed(b"\n")
    assert (d.verdict, d.reason, d.data) == (COMMIT, "limit", pad + b"\n")


def test_an_event_ending_at_the_limit_still_decides() -> None:
    err = error_shapes.openai_error_event("server_error", "x")
    pad = comments(HOLD_LIMIT_BYTES - len(err))
    d, _, _ = run([pad + err + CONTENT])
    assert (d.verdict, d.reason) == (PROVIDER, "server_error")
    d, _, _ = run([pad + b"\n" + err])  # one byte later: the limit decides
    assert (d.verdict, d.reason) == (COMMIT, "limit")


# -- holds_events ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (200, {"Content-Type": "text/event-stream"}, True),
        (200, {"content-type": "Text/Event-Stream; charset=utf-8"}, True),
        (201, {"Content-Type": "text/event-stream", "Content-Encoding": "identity"}, True),
        (200, {"Content-Type": "text/event-stream", "Content-Encoding": "gzip"}, False),
        (200, {"Content-Type": "application/json"}, False),
        (200, {}, False),
        (400, {"Content-Type": "text/event-stream"}, False),
        (304, {"Content-Type": "text/event-stream"}, False),
    ],
)
def test_holds_events(status: int, headers: dict[str, str], expected: bool) -> None:
    assert holds_events(status, CIMultiDict(headers)) is expected


# -- any cut gives the same answer -----------------------------------------------------

TOKENS: dict[str, list[bytes]] = {
    "hold": [KEEP, b": ka\n\n", START, PING, ROLE, b"id: 1\nretry: 5\n\n", b"event: ping\n\n"],
    "output": [
        CONTENT,
        chat_chunk({"reasoning_content": "r"}),
        chat_chunk({"tool_calls": [{"index": 0}]}),
    ],
    "end": [b"data: [DONE]\n\n", data_event({"type": "message_stop"}, "message_stop")],
    "provider": [
        error_shapes.anthropic_error_event("overloaded_error", "Overloaded"),
        error_shapes.openai_error_event("server_error", "x"),
    ],
    "caller": [error_shapes.anthropic_error_event("permission_error", "no")],
}
EXPECTED: dict[str, tuple[Verdict, str] | Verdict] = {
    "output": (COMMIT, "output"),
    "end": (EMPTY, "empty"),
    "provider": PROVIDER,
    "caller": CALLER,
}


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, tuple[Verdict, str] | Verdict]:
    kinds = draw(st.lists(st.sampled_from(sorted(TOKENS)), max_size=8))
    eols = st.sampled_from([b"\n", b"\r\n", b"\r"])  # one line ending per event, mixed
    parts = [draw(st.sampled_from(TOKENS[k])).replace(b"\n", draw(eols)) for k in kinds]
    bom = draw(st.booleans())
    stream = (b"\xef\xbb\xbf" if bom else b"") + b"".join(parts)
    first = next((k for k in kinds if k != "hold"), None)
    if first is None:
        return stream, (EMPTY, "empty") if stream else (COMMIT, "end")
    return stream, EXPECTED[first]


def cut(data: bytes, points: list[int]) -> list[bytes]:
    edges = [0, *sorted(p % (len(data) + 1) for p in points), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@settings(max_examples=300, deadline=None)
@given(streams(), st.lists(st.integers(min_value=0), max_size=12))
def test_any_cut_gives_the_same_decision_and_bytes(
    case: tuple[bytes, tuple[Verdict, str] | Verdict], points: list[int]
) -> None:
    stream, expected = case
    whole, _, _ = run([stream] if stream else [])
    d, _, rest = run(cut(stream, points))
    assert (d.verdict, d.reason) == (whole.verdict, whole.reason)
    if isinstance(expected, Verdict):
        assert d.verdict is expected
    else:
        assert (d.verdict, d.reason) == expected
    assert d.data + rest == stream  # nothing lost, nothing added, order kept
    assert stream.startswith(d.data)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(min_value=-40, max_value=40),
    st.sampled_from(["output", "provider"]),
    st.lists(st.integers(min_value=0), max_size=6),
)
def test_the_limit_does_not_depend_on_the_cut(offset: int, kind: str, points: list[int]) -> None:
    event = TOKENS[kind][0]
    stream = comments(HOLD_LIMIT_BYTES - len(event) + offset) + event
    whole, _, _ = run([stream])
    expected = (COMMIT, "limit") if offset > 0 else (whole.verdict, whole.reason)
    if offset <= 0:
        assert whole.reason != "limit"
    d, _, rest = run(cut(stream, points))
    assert (d.verdict, d.reason) == expected == (whole.verdict, whole.reason)
    assert d.data + rest == stream

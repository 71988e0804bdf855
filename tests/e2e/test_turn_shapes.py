"""The fake upstream's whole-turn shapes (``sidecar.testing.turn_shapes``): the bytes,
the order of the events, the usage they carry, and what the official SDKs make of them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from sidecar.testing import FakeUpstream, Fault, error_shapes, fault_from_json, shapes, turn_shapes
from sidecar.testing.fault import SHAPES

pytestmark = pytest.mark.timeout(15)

PATHS = {
    "openai": "/v1/chat/completions",
    "openrouter": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
}
MODELS = {
    "openai": "deepseek-reasoner",
    "openrouter": "z-ai/glm-4.5",
    "anthropic": "claude-x",
    "responses": "o4-mini",
}
MSGS: Any = [{"role": "user", "content": "hi"}]
THINKING: Any = {"type": "enabled", "budget_tokens": 1024}

NAMES = {
    "openai_reasoning_stream",
    "openrouter_reasoning_stream",
    "anthropic_thinking_stream",
    "responses_reasoning_stream",
    "responses_failed_stream",
    "responses_error_event_stream",
    "openai_empty_stream",
    "openai_length_empty_stream",
    "anthropic_empty_stream",
    "anthropic_max_tokens_empty_stream",
    "responses_empty_stream",
    "responses_incomplete_empty_stream",
    "openai_empty_json",
    "openai_length_empty_json",
    "anthropic_empty_json",
    "anthropic_max_tokens_empty_json",
    "responses_empty_json",
    "responses_incomplete_empty_json",
    "openai_cached_json",
    "anthropic_cached_json",
    "responses_cached_json",
    "openai_cached_stream",
    "anthropic_cached_stream",
    "responses_cached_stream",
}

_LIFE = ["response.created", "response.in_progress"]
_MESSAGE = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
_REASONING = ["reasoning"] * 4
_END = ["finish:stop", "usage", "[DONE]"]
ORDER = {
    "openai_reasoning_stream": ["role", *_REASONING, "content", "content", *_END],
    "openrouter_reasoning_stream": [*_REASONING, "content", "content", *_END],
    "openai_empty_stream": ["role", *_END],
    "openai_length_empty_stream": ["role", "finish:length", "usage", "[DONE]"],
    "openai_cached_stream": ["role", "content", "content", "content", *_END],
    "anthropic_thinking_stream": [
        "message_start",
        "start:thinking",
        "ping",
        *["thinking_delta"] * 3,
        "signature_delta",
        "content_block_stop",
        "start:text",
        "text_delta",
        "text_delta",
        "content_block_stop",
        "message_delta:end_turn",
        "message_stop",
    ],
    "anthropic_empty_stream": ["message_start", "message_delta:end_turn", "message_stop"],
    "anthropic_max_tokens_empty_stream": [
        "message_start",
        "message_delta:max_tokens",
        "message_stop",
    ],
    "anthropic_cached_stream": [
        "message_start",
        "start:text",
        "ping",
        *["text_delta"] * 3,
        "content_block_stop",
        "message_delta:end_turn",
        "message_stop",
    ],
    "responses_reasoning_stream": [
        *_LIFE,
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        *["response.reasoning_summary_text.delta"] * 4,
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        *_MESSAGE,
        "response.completed",
    ],
    "responses_failed_stream": [*_LIFE, "response.failed"],
    "responses_error_event_stream": ["response.created", "error"],
    "responses_empty_stream": [*_LIFE, "response.completed"],
    "responses_incomplete_empty_stream": [*_LIFE, "response.incomplete"],
    "responses_cached_stream": [*_LIFE, *_MESSAGE, "response.completed"],
}
"""The events of each stream, as :func:`label` names them."""


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as f:
        yield f


def provider(name: str) -> str:
    return name.split("_", 1)[0]


async def fetch(
    fake: FakeUpstream, name: str, *, include_usage: bool = True
) -> tuple[int, str, bytes]:
    """POST to the shape's route with ``Fault(shape=name)`` scripted: status, type, body."""
    body: dict[str, Any] = {"model": MODELS[provider(name)], "stream": name.endswith("_stream")}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    fake.script([Fault(shape=name)])
    async with (
        aiohttp.ClientSession(auto_decompress=False) as s,
        s.post(fake.url + PATHS[provider(name)], json=body) as r,
    ):
        return r.status, r.headers.get("Content-Type", ""), await r.read()


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event in ``raw``."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            fields = dict(line.split(": ", 1) for line in block.split("\n"))
            out.append((fields.get("event"), fields["data"]))
    return out


def label(event: str | None, doc: Any) -> str:
    """A short name for one event: its SSE name, refined for Anthropic, or what an
    OpenAI-style chunk carries (``role``, ``reasoning``, ``content``, ``finish:...``, ``usage``)."""
    if event == "content_block_start":
        return f"start:{doc['content_block']['type']}"
    if event == "content_block_delta":
        return str(doc["delta"]["type"])
    if event == "message_delta":
        return f"message_delta:{doc['delta']['stop_reason']}"
    if event is not None:
        return event
    if doc.get("usage"):
        return "usage"
    (choice,) = doc["choices"]
    delta = choice["delta"]
    if choice["finish_reason"]:
        return f"finish:{choice['finish_reason']}"
    if delta.get("reasoning_content") or delta.get("reasoning"):
        return "reasoning"
    return "content" if delta.get("content") else "role"


def docs_of(name: str, body: bytes) -> list[tuple[str | None, Any]]:
    """Each event of a stream (``[DONE]`` as the string), or the one JSON body."""
    if not name.endswith("_stream"):
        return [(None, json.loads(body))]
    return [(e, d if d == "[DONE]" else json.loads(d)) for e, d in sse_events(body)]


def tokens(name: str, body: bytes) -> dict[str, int]:
    """The tokens the usage in ``body`` reports, by the product's mapping rules; a
    later report of a kind replaces an earlier one."""
    out: dict[str, int] = {}
    for _, doc in docs_of(name, body):
        if not isinstance(doc, dict):
            continue
        usage = doc.get("usage")
        for outer in ("message", "response"):
            if usage is None and isinstance(doc.get(outer), dict):
                usage = doc[outer].get("usage")
        if not usage:
            continue
        if "prompt_tokens" in usage:  # OpenAI-style
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            out["input"] = usage["prompt_tokens"] - cached
            out["output"] = usage["completion_tokens"]
            out["cache_read"] = cached
        elif "input_tokens_details" in usage:  # Responses API
            cached = usage["input_tokens_details"]["cached_tokens"]
            out["input"] = usage["input_tokens"] - cached
            out["output"] = usage["output_tokens"]
            out["cache_read"] = cached
        else:  # Anthropic
            keys = {
                "input_tokens": "input",
                "output_tokens": "output",
                "cache_read_input_tokens": "cache_read",
                "cache_creation_input_tokens": "cache_write",
            }
            out |= {kind: usage[key] for key, kind in keys.items() if key in usage}
    return out


# -- the registry ---------------------------------------------------------------------


def test_registry_names_and_expected_tokens() -> None:
    assert turn_shapes.SHAPES == NAMES
    assert not turn_shapes.SHAPES & error_shapes.SHAPES
    assert SHAPES == turn_shapes.SHAPES | error_shapes.SHAPES
    assert set(turn_shapes.EXPECTED_TOKENS) == NAMES
    assert set(ORDER) == {n for n in NAMES if n.endswith("_stream")}
    for name in NAMES:
        assert Fault(shape=name).shape == name
        kinds = set(turn_shapes.EXPECTED_TOKENS[name])
        assert kinds <= {"input", "output", "cache_read", "cache_write"}
    with pytest.raises(KeyError):
        turn_shapes.render_shape("anthropic_overloaded", "m", "r")


# -- the bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NAMES))
async def test_served_as_rendered_one_event_per_write(fake: FakeUpstream, name: str) -> None:
    status, ctype, body = await fetch(fake, name)
    model = MODELS[provider(name)]
    shape = turn_shapes.render_shape(name, model, "fake000001", include_usage=True)
    assert (status, shape.status) == (200, 200)
    assert body == b"".join(shape.chunks)
    if name.endswith("_json"):
        assert ctype == "application/json" and not shape.sse and len(shape.chunks) == 1
        return
    assert ctype.startswith("text/event-stream") and shape.sse
    for chunk in shape.chunks:  # one event per write
        assert chunk.endswith(b"\n\n") and chunk.count(b"\n\n") == 1
    events = docs_of(name, body)
    assert [label(e, d) if d != "[DONE]" else d for e, d in events] == ORDER[name]
    for event, doc in events:  # named events say their name in "type" as well
        assert event is None or doc["type"] == event
    if provider(name) == "responses":
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))


@pytest.mark.parametrize("name", sorted(NAMES))
async def test_expected_tokens_are_the_usage_in_the_bytes(fake: FakeUpstream, name: str) -> None:
    _, _, body = await fetch(fake, name)
    assert tokens(name, body) == turn_shapes.EXPECTED_TOKENS[name]


@pytest.mark.parametrize("name", sorted(n for n in NAMES if n.endswith("_stream")))
async def test_chat_usage_only_when_asked(fake: FakeUpstream, name: str) -> None:
    """OpenAI-style streams carry usage (and ``"usage":null``) only with include_usage;
    OpenRouter sends its usage chunk regardless; the others do not look."""
    _, _, without = await fetch(fake, name, include_usage=False)
    _, _, asked = await fetch(fake, name)
    if name.startswith("openai_"):
        assert b'"usage"' not in without
        assert tokens(name, without) == {}
        assert b',"usage":null}' in asked
    else:
        assert without == asked.replace(b"fake000002", b"fake000001")


async def test_deepseek_reasoning_chunks(fake: FakeUpstream) -> None:
    _, _, body = await fetch(fake, "openai_reasoning_stream")
    head = (
        b'data: {"id":"fake000001","object":"chat.completion.chunk","created":1756752811,'
        b'"model":"deepseek-reasoner","system_fingerprint":"fp_7e73fd9a08","choices":[{"index":0,'
    )
    assert body.startswith(
        head + b'"delta":{"role":"assistant","content":null,"reasoning_content":""},'
        b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
        + head
        + b'"delta":{"content":null,"reasoning_content":"Okay"},'
        b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    )
    assert body.endswith(
        b'"choices":[],"usage":{"prompt_tokens":1317,"completion_tokens":395,'
        b'"total_tokens":1712,"prompt_tokens_details":{"cached_tokens":1024},'
        b'"completion_tokens_details":{"reasoning_tokens":352},'
        b'"prompt_cache_hit_tokens":1024,"prompt_cache_miss_tokens":293}}\n\ndata: [DONE]\n\n'
    )


async def test_openrouter_reasoning_chunk(fake: FakeUpstream) -> None:
    _, _, body = await fetch(fake, "openrouter_reasoning_stream", include_usage=False)
    assert body.startswith(
        b'data: {"id":"gen-1756752811-fake000001","provider":"DeepInfra","model":"z-ai/glm-4.5",'
        b'"object":"chat.completion.chunk","created":1756752811,"choices":[{"index":0,"delta":'
        b'{"role":"assistant","content":"","reasoning":"The user","reasoning_details":'
        b'[{"type":"reasoning.text","text":"The user","format":"unknown","index":0}]},'
        b'"finish_reason":null,"native_finish_reason":null,"logprobs":null}]}\n\n'
    )
    assert (
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null,'
        b'"native_finish_reason":null,"logprobs":null}],"usage":{"prompt_tokens":2210,'
    ) in body


async def test_anthropic_thinking_events_padded_as_the_api(fake: FakeUpstream) -> None:
    _, _, body = await fetch(fake, "anthropic_thinking_stream")
    for event in (
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"thinking","thinking":"","signature":""}      }\n\n'
        b'event: ping\ndata: {"type": "ping"}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"thinking_delta","thinking":"The user"}           }\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"signature_delta","signature":"ErUBCkYIBxgCIkBmYWtlIHNpZ25hdHVyZSBvZi'
        b'B0aGUgZmFrZSB1cHN0cmVhbSB0aGlua2luZw=="}  }\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
        b'"stop_sequence":null},"usage":{"input_tokens":37,"cache_creation_input_tokens":1843,'
        b'"cache_read_input_tokens":12288,"output_tokens":286}   }\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"          }\n\n',
    ):
        assert event in body
    assert body.startswith(
        b'event: message_start\ndata: {"type":"message_start","message":{"model":"claude-x",'
        b'"id":"msg_fake000001","type":"message","role":"assistant","content":[],'
        b'"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":37,'
        b'"cache_creation_input_tokens":1843,"cache_read_input_tokens":12288,"cache_creation":'
        b'{"ephemeral_5m_input_tokens":1843,"ephemeral_1h_input_tokens":0},"output_tokens":4,'
        b'"service_tier":"standard"}}             }\n\n'
    )


async def test_anthropic_empty_turn_has_no_content_block(fake: FakeUpstream) -> None:
    _, _, body = await fetch(fake, "anthropic_max_tokens_empty_stream")
    assert body.endswith(
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens",'
        b'"stop_sequence":null},"usage":{"input_tokens":23,"cache_creation_input_tokens":256,'
        b'"cache_read_input_tokens":6144,"output_tokens":16}      }\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    _, _, body = await fetch(fake, "anthropic_empty_json")
    assert body == (
        b'{"model":"claude-x","id":"msg_fake000002","type":"message","role":"assistant",'
        b'"content":[],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":17,'
        b'"cache_creation_input_tokens":384,"cache_read_input_tokens":2048,"cache_creation":'
        b'{"ephemeral_5m_input_tokens":384,"ephemeral_1h_input_tokens":0},"output_tokens":2,'
        b'"service_tier":"standard"}}'
    )


async def test_responses_reasoning_and_failure_events(fake: FakeUpstream) -> None:
    _, _, body = await fetch(fake, "responses_reasoning_stream")
    assert (
        b"event: response.reasoning_summary_text.delta\n"
        b'data: {"type":"response.reasoning_summary_text.delta","sequence_number":4,'
        b'"item_id":"rs_fake000001","output_index":0,"summary_index":0,"delta":"**Greeting",'
        b'"obfuscation":"Zq7"}\n\n'
    ) in body
    assert body.startswith(
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
        b'"response":{"id":"resp_fake000001","object":"response","created_at":1756752811,'
        b'"status":"in_progress",'
    )
    created = sse_events(body)[0][1]
    assert '"usage":null,"user":null,"metadata":{}}}' in created
    assert body.endswith(
        b'"usage":{"input_tokens":3182,"input_tokens_details":{"cached_tokens":2944},'
        b'"output_tokens":241,"output_tokens_details":{"reasoning_tokens":192},'
        b'"total_tokens":3423},"user":null,"metadata":{}}}\n\n'
    )
    _, _, body = await fetch(fake, "responses_failed_stream")
    failed = sse_events(body)[-1][1]
    assert failed.startswith(
        '{"type":"response.failed","sequence_number":2,"response":{"id":"resp_fake000002",'
        '"object":"response","created_at":1756752811,"status":"failed","background":false,'
        '"error":{"code":"server_error","message":"The model failed to generate a response."},'
    )
    assert '"output":[],' in failed and '"usage":null,' in failed
    _, _, body = await fetch(fake, "responses_error_event_stream")
    assert body.endswith(
        b'event: error\ndata: {"type":"error","code":"server_error","message":"The server had an '
        b'error while processing your request. Sorry about that!","param":null,'
        b'"sequence_number":1}\n\n'
    )


async def test_json_bodies_spaced_as_the_apis(fake: FakeUpstream) -> None:
    _, _, body = await fetch(fake, "openai_length_empty_json")
    assert body.startswith(
        b'{\n  "id": "chatcmpl-fake000001",\n  "object": "chat.completion",\n'
        b'  "created": 1756752811,\n  "model": "deepseek-reasoner",\n  "choices": [\n    {\n'
        b'      "index": 0,\n      "message": {\n        "role": "assistant",\n'
        b'        "content": "",\n'
    )
    assert b'"finish_reason": "length"\n' in body
    assert body.endswith(
        b'  "service_tier": "default",\n  "system_fingerprint": "fp_51e1070cf2"\n}\n'
    )
    _, _, body = await fetch(fake, "responses_incomplete_empty_json")
    assert b'  "status": "incomplete",\n' in body
    assert b'  "incomplete_details": {\n    "reason": "max_output_tokens"\n  },\n' in body
    assert b'  "output": [],\n' in body
    assert body.endswith(b'  "user": null,\n  "metadata": {}\n}')


async def test_shape_through_the_fault_header(fake: FakeUpstream) -> None:
    hdr = {"x-fake-fault": json.dumps({"shape": "anthropic_empty_stream"})}
    async with (
        aiohttp.ClientSession() as s,
        s.post(fake.url + "/v1/messages", json={"model": "claude-x"}, headers=hdr) as r,
    ):
        body = await r.read()
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    assert body == b"".join(
        turn_shapes.render_shape("anthropic_empty_stream", "claude-x", "fake000001").chunks
    )
    assert fault_from_json('{"shape": "responses_failed_stream"}') == Fault(
        shape="responses_failed_stream"
    )


def test_default_responses_stream_has_null_usage_until_completed() -> None:
    events = [
        json.loads(d) for _, d in sse_events(b"".join(shapes.responses_stream("m", ["a"], rid="r")))
    ]
    assert events[0]["type"] == "response.created" and events[0]["response"]["usage"] is None
    assert [e["type"] for e in events if "response" in e and e["response"]["usage"]] == [
        "response.completed"
    ]


# -- the SDKs ---------------------------------------------------------------------------


@pytest.fixture
async def oai(fake: FakeUpstream) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0)
    yield client
    await client.close()


@pytest.fixture
async def claude(fake: FakeUpstream) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = anthropic.AsyncAnthropic(base_url=fake.url, api_key="x", max_retries=0)
    yield client
    await client.close()


async def test_openai_sdk_reads_reasoning_content_and_usage(
    fake: FakeUpstream, oai: openai.AsyncOpenAI
) -> None:
    fake.script(
        [Fault(shape="openai_reasoning_stream"), Fault(shape="openrouter_reasoning_stream")]
    )
    reasoning, text, usage = "", "", None
    stream = await oai.chat.completions.create(
        model="deepseek-reasoner",
        messages=MSGS,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            text += choice.delta.content or ""
        usage = chunk.usage or usage
    assert reasoning == "Okay, the user says hi. A short greeting back."
    assert text == "Hello! How can I help?"
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (1317, 1024)
    assert usage.model_extra == {"prompt_cache_hit_tokens": 1024, "prompt_cache_miss_tokens": 293}

    reasoning, text, usage = "", "", None
    stream = await oai.chat.completions.create(model="z-ai/glm-4.5", messages=MSGS, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            text += choice.delta.content or ""
        usage = chunk.usage or usage
    assert (reasoning, text) == ("The user greets me; reply briefly.", "Hi there!")
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (478, 1536)


async def test_openai_sdk_responses_reasoning_stream(
    fake: FakeUpstream, oai: openai.AsyncOpenAI
) -> None:
    fake.script([Fault(shape="responses_reasoning_stream")])
    stream = await oai.responses.create(model="o4-mini", input="hi", stream=True)
    events = [ev async for ev in stream]
    assert [ev.type for ev in events] == ORDER["responses_reasoning_stream"]
    last = events[-1]
    assert last.type == "response.completed"
    assert last.response.output_text == "Hello! How can I help?"
    usage = last.response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens) == (3182, 2944)
    assert (usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (241, 192)
    summary = "".join(
        ev.delta for ev in events if ev.type == "response.reasoning_summary_text.delta"
    )
    assert summary == "**Greeting the user**\n\nA short reply fits."


async def test_openai_sdk_yields_response_failed_and_error_events(
    fake: FakeUpstream, oai: openai.AsyncOpenAI
) -> None:
    """Neither ``response.failed`` nor the flat ``error`` event raises: the SDK yields
    them as events. Only the ``responses.stream()`` helper complains, when asked for a
    final response it never got."""
    fake.script(
        [Fault(shape="responses_failed_stream"), Fault(shape="responses_error_event_stream")]
    )
    stream = await oai.responses.create(model="o4-mini", input="hi", stream=True)
    events = [ev async for ev in stream]
    assert [ev.type for ev in events] == ORDER["responses_failed_stream"]
    failed = events[-1]
    assert failed.type == "response.failed"
    assert failed.response.status == "failed" and failed.response.usage is None
    assert failed.response.error is not None and failed.response.error.code == "server_error"
    assert failed.response.output == []

    stream = await oai.responses.create(model="o4-mini", input="hi", stream=True)
    events = [ev async for ev in stream]
    assert [ev.type for ev in events] == ["response.created", "error"]
    error = events[-1]
    assert error.type == "error"
    assert (error.code, error.param, error.sequence_number) == ("server_error", None, 1)

    fake.script([Fault(shape="responses_failed_stream")])
    async with oai.responses.stream(model="o4-mini", input="hi") as helper:
        assert [ev.type async for ev in helper] == ORDER["responses_failed_stream"]
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            await helper.get_final_response()


async def test_anthropic_sdk_thinking_stream(
    fake: FakeUpstream, claude: anthropic.AsyncAnthropic
) -> None:
    fake.script([Fault(shape="anthropic_thinking_stream")] * 2)
    async with claude.messages.stream(
        model="claude-x", max_tokens=2048, messages=MSGS, thinking=THINKING
    ) as stream:
        thinking = "".join([ev.thinking async for ev in stream if ev.type == "thinking"])
        message = await stream.get_final_message()
    assert thinking == "The user wants a greeting. Keep it short."
    assert [block.type for block in message.content] == ["thinking", "text"]
    think, text = message.content
    assert think.type == "thinking" and think.signature.startswith("ErUBCkYI")
    assert text.type == "text" and text.text == "Hello! How can I help today?"
    u = message.usage
    assert (u.input_tokens, u.output_tokens) == (37, 286)
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (12288, 1843)

    raw = await claude.messages.create(
        model="claude-x", max_tokens=2048, messages=MSGS, thinking=THINKING, stream=True
    )
    events = [ev.to_dict() async for ev in raw]  # the SDK passes the ping over
    labels = [label(str(ev["type"]), ev) for ev in events]
    assert labels == [t for t in ORDER["anthropic_thinking_stream"] if t != "ping"]


@pytest.mark.parametrize(
    "name", ["openai_cached_stream", "anthropic_cached_stream", "responses_cached_stream"]
)
async def test_sdks_read_the_cached_streams(
    fake: FakeUpstream,
    oai: openai.AsyncOpenAI,
    claude: anthropic.AsyncAnthropic,
    name: str,
) -> None:
    fake.script([Fault(shape=name)])
    got: dict[str, int] = {}
    if name == "openai_cached_stream":
        stream = await oai.chat.completions.create(
            model="gpt-4o", messages=MSGS, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        got = {"input": usage.prompt_tokens - cached, "output": usage.completion_tokens}
        got["cache_read"] = cached
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    elif name == "anthropic_cached_stream":
        async with claude.messages.stream(model="claude-x", max_tokens=64, messages=MSGS) as s:
            message = await s.get_final_message()
        u = message.usage
        got = {"input": u.input_tokens, "output": u.output_tokens}
        got |= {"cache_read": u.cache_read_input_tokens or 0}
        got |= {"cache_write": u.cache_creation_input_tokens or 0}
        text = message.content[0].text if message.content[0].type == "text" else ""
    else:
        async with oai.responses.stream(model="o4-mini", input="hi") as rs:
            response = await rs.get_final_response()
        assert response.usage is not None
        cached = response.usage.input_tokens_details.cached_tokens
        got = {"input": response.usage.input_tokens - cached}
        got |= {"output": response.usage.output_tokens, "cache_read": cached}
        text = response.output_text
    assert text == "Cached prefix hit."
    assert got == turn_shapes.EXPECTED_TOKENS[name]


async def test_sdks_parse_the_json_shapes(
    fake: FakeUpstream, oai: openai.AsyncOpenAI, claude: anthropic.AsyncAnthropic
) -> None:
    finishes = []
    for name in ("openai_empty_json", "openai_length_empty_json", "openai_cached_json"):
        fake.script([Fault(shape=name)])
        c = await oai.chat.completions.create(model="gpt-4o", messages=MSGS)
        assert c.usage is not None and c.usage.prompt_tokens_details is not None
        assert (
            c.usage.prompt_tokens_details.cached_tokens
            == (turn_shapes.EXPECTED_TOKENS[name]["cache_read"])
        )
        finishes.append((c.choices[0].finish_reason, c.choices[0].message.content))
    assert finishes == [("stop", ""), ("length", ""), ("stop", "Cached prefix hit.")]

    stops = []
    for name in (
        "anthropic_empty_json",
        "anthropic_max_tokens_empty_json",
        "anthropic_cached_json",
    ):
        fake.script([Fault(shape=name)])
        m = await claude.messages.create(model="claude-x", max_tokens=64, messages=MSGS)
        want = turn_shapes.EXPECTED_TOKENS[name]
        assert (m.usage.cache_read_input_tokens, m.usage.cache_creation_input_tokens) == (
            want["cache_read"],
            want["cache_write"],
        )
        stops.append((m.stop_reason, [b.type for b in m.content]))
    assert stops == [("end_turn", []), ("max_tokens", []), ("end_turn", ["text"])]

    states = []
    for name in (
        "responses_empty_json",
        "responses_incomplete_empty_json",
        "responses_cached_json",
    ):
        fake.script([Fault(shape=name)])
        r = await oai.responses.create(model="o4-mini", input="hi")
        assert r.usage is not None
        assert (
            r.usage.input_tokens_details.cached_tokens
            == (turn_shapes.EXPECTED_TOKENS[name]["cache_read"])
        )
        reason = r.incomplete_details.reason if r.incomplete_details else None
        states.append((r.status, reason, r.output_text))
    assert states == [
        ("completed", None, ""),
        ("incomplete", "max_output_tokens", ""),
        ("completed", None, "Cached prefix hit."),
    ]

"""The fake upstream's provider error shapes, byte for byte (``Fault(shape=...)``, keep-alives)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from sidecar.testing import FakeUpstream, Fault, error_shapes, fault_from_json

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"

ANTHROPIC_OVERLOADED = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_fake000001","type":"message",'
    b'"role":"assistant","model":"claude-x","content":[],"stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":10,"output_tokens":1}}}\n\n'
    b"event: ping\n"
    b'data: {"type": "ping"}\n\n'
    b"event: error\n"
    b'data: {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}\n\n'
)
OPENAI_ROLE_CHUNK = (
    b'data: {"id":"chatcmpl-fake000001","object":"chat.completion.chunk","created":1753357673,'
    b'"model":"gpt-4o","service_tier":"default","system_fingerprint":"fp_51e1070cf2",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},'
    b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
)
OPENAI_SERVER_ERROR = OPENAI_ROLE_CHUNK + (
    b'data: {"error": {"message": "The server had an error while processing your request.'
    b' Sorry about that!", "type": "server_error"}}\n\n'
)
OPENAI_CONTEXT_400 = (
    b"{\n"
    b'  "error": {\n'
    b'    "message": "This model\'s maximum context length is 128000 tokens. However, your'
    b' messages resulted in 130532 tokens. Please reduce the length of the messages.",\n'
    b'    "type": "invalid_request_error",\n'
    b'    "param": "messages",\n'
    b'    "code": "context_length_exceeded"\n'
    b"  }\n"
    b"}"
)
ANTHROPIC_CONTEXT_400 = (
    b'{"type":"error","error":{"type":"invalid_request_error",'
    b'"message":"prompt is too long: 208310 tokens > 200000 maximum"},'
    b'"request_id":"req_011CV5Jab6gR3ZNs9Sj6apiD"}'
)


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as f:
        yield f


async def post(
    fake: FakeUpstream, path: str, model: str, headers: dict[str, str] | None = None
) -> tuple[int, str, bytes]:
    async with (
        aiohttp.ClientSession(auto_decompress=False) as s,
        s.post(fake.url + path, json={"model": model, "stream": True}, headers=headers) as r,
    ):
        return r.status, r.headers.get("Content-Type", ""), await r.read()


@pytest.mark.parametrize(
    ("shape", "path", "model", "status", "sse", "body"),
    [
        ("anthropic_overloaded", MESSAGES, "claude-x", 200, True, ANTHROPIC_OVERLOADED),
        ("openai_server_error", CHAT, "gpt-4o", 200, True, OPENAI_SERVER_ERROR),
        ("openai_context_window", CHAT, "gpt-4o", 400, False, OPENAI_CONTEXT_400),
        ("anthropic_context_window", MESSAGES, "claude-x", 400, False, ANTHROPIC_CONTEXT_400),
    ],
)
async def test_shapes_are_the_providers_bytes(
    fake: FakeUpstream, shape: str, path: str, model: str, status: int, sse: bool, body: bytes
) -> None:
    fake.set_default(Fault(shape=shape))
    got_status, ctype, got = await post(fake, path, model)
    assert (got_status, got) == (status, body)
    assert ctype.startswith("text/event-stream" if sse else "application/json")


async def test_caller_error_streams(fake: FakeUpstream) -> None:
    fake.script([Fault(shape="anthropic_invalid_request"), Fault(shape="openai_invalid_request")])
    _, _, body = await post(fake, MESSAGES, "claude-x")
    assert body.endswith(
        b"event: error\ndata: "
        b'{"type": "error", "error": {"type": "invalid_request_error", "message": '
        b'"Invalid request"}}\n\n'
    )
    _, _, body = await post(fake, CHAT, "gpt-4o")
    assert body.endswith(
        b'data: {"error": {"message": "Invalid request", "type": "invalid_request_error"}}\n\n'
    )


async def test_keepalives_come_first_one_write_each(fake: FakeUpstream) -> None:
    fake.set_default(Fault(shape="openai_server_error", keepalives=2))
    _, _, body = await post(fake, CHAT, "gpt-4o")
    assert body == b": OPENROUTER PROCESSING\n\n" * 2 + OPENAI_SERVER_ERROR
    fake.set_default(Fault(keepalives=1, chunks=1, text="Hi"))
    _, _, body = await post(fake, CHAT, "gpt-4o")
    assert body.startswith(b": OPENROUTER PROCESSING\n\ndata: {")
    assert body.endswith(b"data: [DONE]\n\n")


async def test_shape_through_the_fault_header(fake: FakeUpstream) -> None:
    hdr = {"x-fake-fault": json.dumps({"shape": "anthropic_overloaded"})}
    status, _, body = await post(fake, MESSAGES, "claude-x", hdr)
    assert (status, body) == (200, ANTHROPIC_OVERLOADED)
    status, _, body = await post(fake, CHAT, "gpt-4o", {"x-fake-fault": '{"shape": "nope"}'})
    assert status == 400 and b"unknown shape" in body


def test_fault_checks_shape_and_keepalives() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        Fault(shape="nope")
    with pytest.raises(ValueError, match="keepalives"):
        fault_from_json('{"keepalives": -1}')
    assert fault_from_json('{"shape": "openai_server_error", "keepalives": 3}') == Fault(
        shape="openai_server_error", keepalives=3
    )
    assert set(error_shapes.SHAPES) == {
        "anthropic_overloaded",
        "anthropic_api_error",
        "anthropic_invalid_request",
        "openai_server_error",
        "openai_invalid_request",
        "openai_context_window",
        "anthropic_context_window",
    }
    for name in error_shapes.SHAPES:
        error_shapes.render_shape(name, "m", "r")


async def test_openai_sdk_sees_the_shapes_as_errors(fake: FakeUpstream) -> None:
    client = openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0)
    msgs: Any = [{"role": "user", "content": "hi"}]
    try:
        fake.set_default(Fault(shape="openai_server_error"))
        stream = await client.chat.completions.create(model="gpt-4o", messages=msgs, stream=True)
        with pytest.raises(openai.APIError, match="The server had an error"):
            async for _ in stream:
                pass
        fake.set_default(Fault(shape="openai_context_window"))
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="gpt-4o", messages=msgs)
        assert info.value.code == "context_length_exceeded"
    finally:
        await client.close()

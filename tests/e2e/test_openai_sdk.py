"""End to end with real clients: the official ``openai`` SDK and ``curl -N``.

The SDK talks to the sidecar (``base_url=<proxy>/v1``, ``max_retries=0`` so every
retry seen is the sidecar's), the sidecar to the fake upstreams.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Mapping
from typing import Any

import openai
import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault, closed_port
from tests.configs import fallback, single
from tests.conftest import StartSidecar, on_fake_time

HELLO = "Hello from the fake upstream"  # 5 chunks of DEFAULT_WORDS
MESSAGES: Any = [{"role": "user", "content": "hi"}]
KEY = "sk-sdk-test-key"


def pair(
    a: str,
    b: str,
    *,
    primary: Mapping[str, Any] | None = None,
    backup: Mapping[str, Any] | None = None,
) -> str:
    """``primary`` (1 retry, 10 ms backoff) then ``backup`` (no retry), both keyed by
    ``SDK_TEST_KEY``; ``primary`` / ``backup`` add keys to each."""
    return fallback(
        a,
        b,
        primary={
            "api_key_env": "SDK_TEST_KEY",
            "retry": {"max_retries": 1, "backoff_initial_ms": 10},
            **(primary or {}),
        },
        backup={"api_key_env": "SDK_TEST_KEY", "retry": {"max_retries": 0}, **(backup or {})},
    )


ENV = {"SDK_TEST_KEY": KEY}


@pytest.fixture
async def sdk() -> AsyncIterator[list[openai.AsyncOpenAI]]:
    """Clients made with :func:`client` are closed after the test."""
    made: list[openai.AsyncOpenAI] = []
    yield made
    for c in made:
        await c.close()


def client(made: list[openai.AsyncOpenAI], sc: Sidecar) -> openai.AsyncOpenAI:
    c = openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key="k", max_retries=0)
    made.append(c)
    return c


async def test_chat_completion_non_streaming_and_streaming(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    sdk: list[openai.AsyncOpenAI],
) -> None:
    sc = await start_sidecar(pair(fake.url, fake2.url), environ=ENV)
    c = client(sdk, sc)
    done = await c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert done.choices[0].message.content == HELLO
    assert done.model == "gpt-4o"

    stream = await c.chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        assert chunk.model == "gpt-4o-mini"
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert text == HELLO
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == 5
    assert fake.request_count == 2 and fake2.request_count == 0
    for rec in fake.requests:
        assert rec.headers.getall("Authorization") == [f"Bearer {KEY}"]


async def test_embeddings_and_models_through_the_sidecar(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    sdk: list[openai.AsyncOpenAI],
) -> None:
    sc = await start_sidecar(pair(fake.url, fake2.url), environ=ENV)
    c = client(sdk, sc)
    e = await c.embeddings.create(model="text-embedding-3-small", input=["a", "b", "c"])
    assert [d.index for d in e.data] == [0, 1, 2]
    assert len(e.data[0].embedding) == 8
    models = [m.id async for m in c.models.list()]
    assert "gpt-4o" in models


async def test_primary_503_falls_back_and_the_sdk_gets_the_completion(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    sdk: list[openai.AsyncOpenAI],
) -> None:
    fake.set_default(Fault(status=503))
    sc = await start_sidecar(pair(fake.url, fake2.url), environ=ENV)
    c = client(sdk, sc)
    raw = await c.chat.completions.with_raw_response.create(model="gpt-4o", messages=MESSAGES)
    assert raw.headers["x-sidecar-upstream"] == "backup"
    assert raw.headers["x-sidecar-attempts"] == "3"
    done = raw.parse()
    assert done.choices[0].message.content == HELLO
    assert (fake.request_count, fake2.request_count) == (2, 1)


async def test_streaming_falls_back_when_the_primary_is_silent(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    sdk: list[openai.AsyncOpenAI],
    clock: FakeClock,
) -> None:
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
    sc = await start_sidecar(
        pair(fake.url, fake2.url, primary={"first_byte_timeout_ms": 150}), environ=ENV
    )
    c = client(sdk, sc)
    create = c.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    stream = await on_fake_time(clock, fake, [(1, 0.15)], create)
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text == HELLO
    assert (fake.request_count, fake2.request_count) == (1, 1)


async def test_circuit_open_raises_the_sdks_internal_server_error(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    sdk: list[openai.AsyncOpenAI],
) -> None:
    fake.set_default(Fault(status=503))
    fake2.set_default(Fault(status=503))
    cb = {"circuit_breaker": {"failure_threshold": 1, "cooldown_ms": 60000}}
    sc = await start_sidecar(pair(fake.url, fake2.url, primary=cb, backup=cb), environ=ENV)
    c = client(sdk, sc)
    with pytest.raises(openai.InternalServerError) as first:
        await c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert first.value.status_code == 503
    assert first.value.response.headers["x-sidecar-upstream"] == "backup"  # relayed 503
    with pytest.raises(openai.InternalServerError) as opened:
        await c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert opened.value.status_code == 503
    assert opened.value.code == "circuit_open"
    assert opened.value.response.headers["x-sidecar-error"] == "circuit_open"
    assert opened.value.response.headers["Retry-After"] == "60"
    assert (fake.request_count, fake2.request_count) == (2, 1)


async def test_upstream_unavailable_raises_the_sdks_internal_server_error(
    start_sidecar: StartSidecar, sdk: list[openai.AsyncOpenAI]
) -> None:
    down = f"http://127.0.0.1:{closed_port()}"
    sc = await start_sidecar(pair(down, down), environ=ENV)
    c = client(sdk, sc)
    with pytest.raises(openai.InternalServerError) as err:
        await c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.status_code == 502
    assert err.value.code == "upstream_unavailable"
    assert isinstance(err.value, openai.APIStatusError)


async def test_no_route_raises_not_found(
    fake: FakeUpstream, start_sidecar: StartSidecar, sdk: list[openai.AsyncOpenAI]
) -> None:
    sc = await start_sidecar(single(fake.url, path_prefix="/v1/chat/"))
    c = client(sdk, sc)
    with pytest.raises(openai.NotFoundError) as err:
        await c.embeddings.create(model="text-embedding-3-small", input="a")
    assert err.value.status_code == 404
    assert err.value.code == "no_route"
    assert fake.request_count == 0


async def test_upstream_rate_limit_reaches_the_sdk_as_rate_limit_error(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    sdk: list[openai.AsyncOpenAI],
) -> None:
    fake.set_default(Fault(status=429, retry_after="3600"))
    fake2.set_default(Fault(status=429, retry_after="3600"))
    sc = await start_sidecar(pair(fake.url, fake2.url), environ=ENV)
    c = client(sdk, sc)
    with pytest.raises(openai.RateLimitError) as err:
        await c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.response.headers["Retry-After"] == "3600"
    assert (fake.request_count, fake2.request_count) == (1, 1)


async def test_midstream_cut_is_an_error_in_the_sdk_not_a_short_answer(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    sdk: list[openai.AsyncOpenAI],
) -> None:
    fake.set_default(Fault(reset_after_chunks=3))
    sc = await start_sidecar(pair(fake.url, fake2.url), environ=ENV)
    c = client(sdk, sc)
    stream = await c.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    text = ""
    with pytest.raises(openai.APIConnectionError):
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    assert text == "Hello from"
    assert fake2.request_count == 0


# -- curl -N --------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect_100_continue"])
async def test_curl_streams_an_sse_completion(
    fake: FakeUpstream, fake2: FakeUpstream, start_sidecar: StartSidecar, expect: bool
) -> None:
    fake.set_default(Fault(status=503))
    sc = await start_sidecar(pair(fake.url, fake2.url), environ=ENV)
    prompt = "hi " * (1000 if expect else 1)
    payload = json.dumps(
        {"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    )
    extra = ["-H", "Expect: 100-continue"] if expect else []
    proc = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        "-N",
        "--max-time",
        "20",
        "-H",
        "Content-Type: application/json",
        "-H",
        "Authorization: Bearer client-key",
        *extra,
        "--data-binary",
        payload,
        "-D",
        "-",
        sc.proxy_url + "/v1/chat/completions",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(25):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    head, _, body = text.partition("\r\n\r\n")
    if expect:  # the interim answer comes first
        assert head == "HTTP/1.1 100 Continue"
        head, _, body = body.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200")
    assert "x-sidecar-upstream: backup" in head.lower()
    assert body.count("data: ") == 8  # role, 5 deltas, finish, [DONE]
    assert body.endswith("data: [DONE]\n\n")
    assert fake2.requests[0].headers.getall("Authorization") == [f"Bearer {KEY}"]
    assert fake2.requests[0].body == payload.encode()

"""Whole turns through the sidecar with the official SDKs as the clients.

Contract (/work/shared/design/interface.md), "What it is" (responses streamed byte for
byte, so an SDK reads a provider's stream through the sidecar as it would directly),
"Streamed answers" (reasoning is output; ``response.failed`` before output falls back)
and "An empty turn is a failure". The SDKs talk to the sidecar's proxy URL with
``max_retries=0`` (every retry seen is the sidecar's); the sidecar to fake upstreams
answering :mod:`sidecar.testing.turn_shapes`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream, Fault
from tests.breaker_e2e_helpers import entry
from tests.conftest import StartSidecar
from tests.turn_helpers import ATTEMPTS, chain_config, delta_since, scrape

MSGS: Any = [{"role": "user", "content": "hi"}]
THINKING: Any = {"type": "enabled", "budget_tokens": 1024}
LIFE = ["response.created", "response.in_progress"]
MESSAGE = [
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 3,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
REASONING_ORDER = [
    *LIFE,
    "response.output_item.added",
    "response.reasoning_summary_part.added",
    *["response.reasoning_summary_text.delta"] * 4,
    "response.reasoning_summary_text.done",
    "response.reasoning_summary_part.done",
    "response.output_item.done",
    *MESSAGE,
    "response.completed",
]
"""The Responses API events of ``responses_reasoning_stream``, in order."""


@pytest.fixture
async def clients() -> AsyncIterator[list[openai.AsyncOpenAI | anthropic.AsyncAnthropic]]:
    """SDK clients made by :func:`oai` / :func:`claude` are closed after the test."""
    made: list[openai.AsyncOpenAI | anthropic.AsyncAnthropic] = []
    yield made
    for c in made:
        await c.close()


def oai(made: list[Any], sc: Sidecar) -> openai.AsyncOpenAI:
    c = openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key="sk-test", max_retries=0)
    made.append(c)
    return c


def claude(made: list[Any], sc: Sidecar) -> anthropic.AsyncAnthropic:
    c = anthropic.AsyncAnthropic(base_url=sc.proxy_url, api_key="sk-ant-test", max_retries=0)
    made.append(c)
    return c


# -- 11. the openai SDK ------------------------------------------------------------------


async def test_openai_sdk_chat_stream_gets_every_reasoning_delta_the_content_and_usage(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    clients: list[Any],
) -> None:
    """Contract, "Streamed answers": reasoning deltas are output and go to the client as
    they came: the SDK reads every ``reasoning_content`` delta (DeepSeek), the content
    and the usage chunk (``stream_options.include_usage``)."""
    sc = await start_sidecar(chain_config(fake.url))
    fake.set_default(Fault(shape="openai_reasoning_stream"))
    stream = await oai(clients, sc).chat.completions.create(
        model="deepseek-reasoner",
        messages=MSGS,
        stream=True,
        stream_options={"include_usage": True},
    )
    thoughts: list[str] = []
    text, usage = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                thoughts.append(extra["reasoning_content"])
            text += choice.delta.content or ""
        usage = chunk.usage or usage
    assert thoughts == ["Okay", ", the user", " says hi.", " A short greeting back."]
    assert text == "Hello! How can I help?"
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (1317, 395)
    assert usage.prompt_tokens_details.cached_tokens == 1024
    assert fake.request_count == 1


async def test_openai_sdk_chat_stream_gets_openrouter_reasoning(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    clients: list[Any],
) -> None:
    """Contract, "Streamed answers": OpenRouter's ``reasoning`` deltas commit and are
    relayed; the SDK reads them and the usage chunk OpenRouter always sends."""
    sc = await start_sidecar(chain_config(fake.url))
    fake.set_default(Fault(shape="openrouter_reasoning_stream"))
    stream = await oai(clients, sc).chat.completions.create(
        model="z-ai/glm-4.5", messages=MSGS, stream=True
    )
    reasoning, text, usage = "", "", None
    async for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            text += choice.delta.content or ""
        usage = chunk.usage or usage
    assert (reasoning, text) == ("The user greets me; reply briefly.", "Hi there!")
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (478, 1536)


async def test_openai_sdk_responses_stream_gets_the_events_in_order_and_the_usage(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    clients: list[Any],
) -> None:
    """Contract, "Streamed answers": the Responses API's held lifecycle events go out
    with the first reasoning delta, unchanged: the SDK sees every event in order, the
    reasoning summary and ``response.completed``'s usage."""
    sc = await start_sidecar(chain_config(fake.url))
    fake.set_default(Fault(shape="responses_reasoning_stream"))
    stream = await oai(clients, sc).responses.create(model="o4-mini", input="hi", stream=True)
    events = [ev async for ev in stream]
    assert [ev.type for ev in events] == REASONING_ORDER
    summary = "".join(
        ev.delta for ev in events if ev.type == "response.reasoning_summary_text.delta"
    )
    assert summary == "**Greeting the user**\n\nA short reply fits."
    last = events[-1]
    assert last.type == "response.completed"
    assert last.response.output_text == "Hello! How can I help?"
    usage = last.response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens) == (3182, 2944)
    assert (usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (241, 192)


@pytest.mark.parametrize("shape", ["responses_failed_stream", "responses_error_event_stream"])
async def test_openai_sdk_sees_a_normal_stream_from_the_fallback_after_response_failed(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clients: list[Any],
    shape: str,
) -> None:
    """Contract, "Streamed answers": ``response.failed`` (or the ``error`` event) before
    any output is a failure before the commit point: retried, then the next candidate;
    the SDK sees only the fallback's normal, completed stream."""
    sc = await start_sidecar(chain_config(fake.url, fake2.url, retries=1))
    fake.set_default(Fault(shape=shape))
    fake2.set_default(Fault(shape="responses_cached_stream"))
    before = await scrape(http, sc)
    raw = await oai(clients, sc).responses.with_raw_response.create(
        model="o4-mini", input="hi", stream=True
    )
    assert raw.headers["x-sidecar-upstream"] == "backup"
    events = [ev async for ev in raw.parse()]
    assert [ev.type for ev in events] == [*LIFE, *MESSAGE, "response.completed"]
    last = events[-1]
    assert last.type == "response.completed"
    assert last.response.status == "completed" and last.response.error is None
    assert last.response.output_text == "Cached prefix hit."
    assert last.response.usage is not None and last.response.usage.output_tokens == 44
    assert (fake.request_count, fake2.request_count) == (2, 1)
    d = await delta_since(http, sc, before)
    assert d(ATTEMPTS, upstream="primary", outcome="sse_error") == 2
    assert (await entry(http, sc))["last_failure"] == "sse_error"


async def test_openai_sdk_gets_the_fallbacks_answer_after_an_empty_turn(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    clients: list[Any],
) -> None:
    """Contract, "An empty turn is a failure": an empty ``chat.completion`` is retried
    once, then the next candidate answers: the SDK gets a message with content."""
    sc = await start_sidecar(chain_config(fake.url, fake2.url, retries=2))
    fake.set_default(Fault(shape="openai_empty_json"))
    fake2.set_default(Fault(shape="openai_cached_json"))
    done = await oai(clients, sc).chat.completions.create(model="gpt-4o", messages=MSGS)
    assert done.choices[0].message.content == "Cached prefix hit."
    assert done.usage is not None and done.usage.prompt_tokens == 2006
    assert (fake.request_count, fake2.request_count) == (2, 1)


# -- 12. the anthropic SDK -------------------------------------------------------------


async def test_anthropic_sdk_stream_gets_thinking_and_text_blocks_and_cache_usage(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    clients: list[Any],
) -> None:
    """Contract, "Streamed answers": an extended-thinking stream commits at its first
    ``thinking_delta`` and is relayed unchanged: the SDK's stream helper gets the
    thinking (with its signature) and the text blocks, and the final usage with the
    cache fields."""
    sc = await start_sidecar(chain_config(fake.url))
    fake.set_default(Fault(shape="anthropic_thinking_stream"))
    async with claude(clients, sc).messages.stream(
        model="claude-x", max_tokens=2048, messages=MSGS, thinking=THINKING
    ) as stream:
        thinking = "".join([ev.thinking async for ev in stream if ev.type == "thinking"])
        message = await stream.get_final_message()
    assert thinking == "The user wants a greeting. Keep it short."
    assert [block.type for block in message.content] == ["thinking", "text"]
    think, text = message.content
    assert think.type == "thinking" and think.signature.startswith("ErUBCkYI")
    assert text.type == "text" and text.text == "Hello! How can I help today?"
    assert message.stop_reason == "end_turn"
    u = message.usage
    assert (u.input_tokens, u.output_tokens) == (37, 286)
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (12288, 1843)


async def test_anthropic_sdk_raw_stream_gets_every_event(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    clients: list[Any],
) -> None:
    """Contract, "Streamed answers": ``messages.create(stream=True, thinking=...)``
    through the sidecar yields the provider's events in order (the SDK passes pings
    over): the held ``message_start`` and ``content_block_start`` come first."""
    sc = await start_sidecar(chain_config(fake.url))
    fake.set_default(Fault(shape="anthropic_thinking_stream"))
    raw = await claude(clients, sc).messages.create(
        model="claude-x", max_tokens=2048, messages=MSGS, thinking=THINKING, stream=True
    )
    events = [ev async for ev in raw]
    assert [ev.type for ev in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 4,
        "content_block_stop",
        "content_block_start",
        *["content_block_delta"] * 2,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]
    assert start.type == "message_start"
    assert start.message.usage.cache_read_input_tokens == 12288
    delta = events[-2]
    assert delta.type == "message_delta" and delta.usage.output_tokens == 286

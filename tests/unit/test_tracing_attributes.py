"""The spans' plain values (:mod:`sidecar.tracing.attributes`) and the batch settings
read from the ``OTEL_BSP_*`` variables (:func:`sidecar.tracing.export.batch_settings`)."""

from __future__ import annotations

import pytest

from sidecar.tracing.attributes import (
    attempt_reason,
    breaker_state,
    client_span_name,
    operation_name,
    traceparent,
    usage_attributes,
)
from sidecar.tracing.export import BatchSettings, batch_settings
from sidecar.usage import Usage


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/chat/completions", "chat"),
        ("/openai/deployments/x/chat/completions", "chat"),
        ("/v1/messages", "chat"),
        ("/v1/responses", "chat"),
        ("/v1/completions", "text_completion"),
        ("/v1/embeddings", "embeddings"),
        ("/v1/embeddings/", "embeddings"),
        ("/v1/models", None),
        ("/v1/messages/count_tokens", None),
        ("/", None),
    ],
)
def test_operation_name(path: str, name: str | None) -> None:
    assert operation_name(path) == name


@pytest.mark.parametrize(
    ("call", "retry", "probe", "reason"),
    [
        ("first", 0, False, "first"),
        ("first", 1, False, "retry"),
        ("fallback", 0, False, "fallback"),
        ("fallback", 2, False, "retry"),
        ("first", 0, True, "probe"),
        ("fallback", 0, True, "probe"),
        ("hedge", 0, False, "hedge"),
        ("hedge", 0, True, "hedge"),
        ("hedge", 1, False, "hedge"),
    ],
)
def test_attempt_reason(call: str, retry: int, probe: bool, reason: str) -> None:
    assert attempt_reason(call, retry, probe) == reason


def test_breaker_state() -> None:
    assert breaker_state(-1, False) == "none"
    assert breaker_state(0, False) == "closed"
    assert breaker_state(3, True) == "half_open"


def usage(**kinds: int) -> Usage:
    u = Usage()
    for k, v in kinds.items():
        setattr(u, k, v)
    return u


def test_input_tokens_include_the_cached_ones_as_the_genai_conventions_count_them() -> None:
    assert usage_attributes(None) == {}
    assert usage_attributes(Usage()) == {}
    # OpenAI: prompt_tokens 100 of which 30 cached -> input 70, cache_read 30.
    assert usage_attributes(usage(input=70, cache_read=30, output=5)) == {
        "gen_ai.usage.input_tokens": 100,
        "gen_ai.usage.output_tokens": 5,
    }
    # Anthropic: input, cache reads and cache writes are three counts.
    assert usage_attributes(usage(input=3, cache_read=40, cache_write=7)) == {
        "gen_ai.usage.input_tokens": 50
    }
    assert usage_attributes(usage(output=0)) == {"gen_ai.usage.output_tokens": 0}


def test_client_span_name_and_traceparent() -> None:
    assert client_span_name("chat", "gpt-4o") == "chat gpt-4o"
    assert client_span_name(None, "m") == "m"
    assert client_span_name(None, None) == "upstream"
    assert traceparent(1, 2, True) == "00-00000000000000000000000000000001-0000000000000002-01"
    assert traceparent(2**128 - 1, 2**64 - 1, False) == f"00-{'f' * 32}-{'f' * 16}-00"


def test_batch_settings_from_the_otel_bsp_variables() -> None:
    assert batch_settings({}) == BatchSettings(2048, 512, 5000)
    env = {
        "OTEL_BSP_MAX_QUEUE_SIZE": "100",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "500",  # never larger than the queue
        "OTEL_BSP_SCHEDULE_DELAY": "250",
    }
    assert batch_settings(env) == BatchSettings(100, 100, 250)
    bad = {"OTEL_BSP_MAX_QUEUE_SIZE": "lots", "OTEL_BSP_SCHEDULE_DELAY": "-1"}
    assert batch_settings(bad) == BatchSettings()

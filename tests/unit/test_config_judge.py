"""Config keys of issue 12: circuit_breaker.slow_call_ms, routes[].context_window_fallback,
server.client_retry_hint (defaults, values, errors with key paths, env, rendering)."""

from __future__ import annotations

import pytest

from sidecar.config import (
    BreakerConfig,
    ConfigError,
    ServerConfig,
    load_config,
    parse_config,
    render_effective,
)

BASE = """
[upstreams.openai]
base_url = "https://api.openai.com"

[upstreams.openai.circuit_breaker]

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{ upstream = "openai" }]
"""


def with_lines(server: str = "", breaker: str = "", route: str = "", upstream: str = "") -> str:
    text = BASE.replace("[[routes]]\n", "[[routes]]\n" + route + "\n")
    text = text.replace(
        "[upstreams.openai.circuit_breaker]\n", f"[upstreams.openai.circuit_breaker]\n{breaker}\n"
    )
    text = text.replace('"https://api.openai.com"\n', f'"https://api.openai.com"\n{upstream}\n')
    return f"[server]\n{server}\n" + text


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, {})
    return exc.value.errors


def test_defaults() -> None:
    c = parse_config(BASE, {})
    assert c.server.client_retry_hint is True
    assert ServerConfig().client_retry_hint is True
    breaker = c.upstreams["openai"].circuit_breaker
    assert breaker is not None and breaker.slow_call_ms == 0 and breaker.slow_call_s == 0.0
    assert BreakerConfig().slow_call_ms == 0
    assert c.routes[0].context_window_fallback is True
    embedded = load_config(None, {})
    assert embedded.server.client_retry_hint is True
    assert all(r.context_window_fallback for r in embedded.routes)


def test_values() -> None:
    c = parse_config(
        with_lines(
            server="client_retry_hint = false",
            breaker="slow_call_ms = 2500",
            route="context_window_fallback = false",
        ),
        {},
    )
    assert c.server.client_retry_hint is False
    breaker = c.upstreams["openai"].circuit_breaker
    assert breaker is not None and breaker.slow_call_ms == 2500 and breaker.slow_call_s == 2.5
    assert c.routes[0].context_window_fallback is False
    assert parse_config(render_effective(c), {}) == c


def test_slow_call_ms_zero_is_off_and_valid() -> None:
    c = parse_config(with_lines(breaker="slow_call_ms = 0"), {})
    assert c.upstreams["openai"].circuit_breaker == BreakerConfig()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"breaker": "slow_call_ms = -1"},
            "upstreams.openai.circuit_breaker.slow_call_ms: must be >= 0",
        ),
        (
            {"breaker": "slow_call_ms = 1.5"},
            "upstreams.openai.circuit_breaker.slow_call_ms: expected an integer, got a float",
        ),
        (
            {"breaker": 'slow_call_ms = "2000"'},
            "upstreams.openai.circuit_breaker.slow_call_ms: expected an integer, got a string",
        ),
        (
            {"upstream": "slow_call_ms = 2000"},
            "upstreams.openai.slow_call_ms: unknown key;"
            ' did you mean "circuit_breaker.slow_call_ms"?',
        ),
        (
            {"route": 'context_window_fallback = "yes"'},
            "routes[0].context_window_fallback: expected a boolean, got a string",
        ),
        (
            {"server": "client_retry_hint = 1"},
            "server.client_retry_hint: expected a boolean, got an integer",
        ),
        (
            {"server": "context_window_fallback = true"},
            "server.context_window_fallback: unknown key",
        ),
    ],
)
def test_errors_name_their_key_path(kwargs: dict[str, str], expected: str) -> None:
    assert errors_of(with_lines(**kwargs)) == [expected]


def test_environment_overrides() -> None:
    env = {
        "SIDECAR__SERVER__CLIENT_RETRY_HINT": "false",
        "SIDECAR__UPSTREAMS__OPENAI__CIRCUIT_BREAKER__SLOW_CALL_MS": "1500",
    }
    c = parse_config(BASE, env)
    assert c.server.client_retry_hint is False
    breaker = c.upstreams["openai"].circuit_breaker
    assert breaker is not None and breaker.slow_call_ms == 1500
    bad = parse_config_errors(
        BASE, {"SIDECAR__UPSTREAMS__OPENAI__CIRCUIT_BREAKER__SLOW_CALL_MS": "-2"}
    )
    assert len(bad) == 1 and bad[0].startswith("upstreams.openai.circuit_breaker.slow_call_ms")
    assert "must be >= 0" in bad[0]


def parse_config_errors(text: str, env: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, env)
    return exc.value.errors


# -- circuit_breaker.failure_rate_threshold, window_ms, minimum_calls (issue 22) ---------


def test_failure_rate_defaults_are_off() -> None:
    breaker = parse_config(BASE, {}).upstreams["openai"].circuit_breaker
    assert breaker is not None
    assert (breaker.failure_rate_threshold, breaker.window_ms, breaker.minimum_calls) == (
        0.0,
        60000,
        20,
    )


def test_failure_rate_values_reach_the_breaker_settings() -> None:
    from sidecar.generation import breaker_settings

    c = parse_config(
        with_lines(breaker="failure_rate_threshold = 0.25\nwindow_ms = 30000\nminimum_calls = 5"),
        {},
    )
    (settings,) = breaker_settings(c).values()
    assert (settings.failure_rate, settings.window_s, settings.minimum_calls) == (0.25, 30.0, 5)
    assert parse_config(render_effective(c), {}) == c


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("failure_rate_threshold = 1.5", "failure_rate_threshold: expected `float` <= 1.0"),
        ("failure_rate_threshold = -0.5", "failure_rate_threshold: expected `float` >= 0.0"),
        ("window_ms = 0", "window_ms: must be > 0"),
        ("minimum_calls = 0", "minimum_calls: must be > 0"),
    ],
)
def test_failure_rate_errors_name_their_key_path(line: str, message: str) -> None:
    errors = errors_of(with_lines(breaker=line))
    assert errors == [f"upstreams.openai.circuit_breaker.{message}"]

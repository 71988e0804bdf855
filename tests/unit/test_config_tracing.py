"""``[tracing]`` (contract, "Configuration" and "Traces"): defaults, every rule with its
key path, environment overrides, and the effective config."""

from __future__ import annotations

import pytest

from sidecar.config import ConfigError, TracingConfig, parse_config, render_effective

BASE = """
[upstreams.openai]
base_url = "https://api.openai.com"

[[routes]]
name = "chat"
candidates = [{ upstream = "openai" }]
"""


def errors_of(text: str, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + text, environ or {})
    return e.value.errors


def test_absent_is_off_and_an_empty_table_takes_the_contracts_defaults() -> None:
    assert parse_config(BASE, {}).tracing is None
    assert parse_config(BASE + "[tracing]\n", {}).tracing == TracingConfig(
        otlp_endpoint="http://127.0.0.1:4318/v1/traces",
        sample_ratio=1.0,
        propagate=False,
        service_name="sidecar",
    )


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ("sample_ratio = 1.5", "tracing.sample_ratio: expected `float` <= 1.0"),
        ("sample_ratio = -0.1", "tracing.sample_ratio: expected `float` >= 0.0"),
        ('sample_ratio = "all"', "tracing.sample_ratio: expected a float, got a string"),
        ('propagate = "yes"', "tracing.propagate: expected a boolean, got a string"),
        ('service_name = ""', "tracing.service_name: must be 1..255 printable characters"),
        (
            'otlp_endpoint = "grpc://127.0.0.1:4317"',
            "tracing.otlp_endpoint: must start with http:// or https://",
        ),
        ('otlp_endpoint = "http:///v1/traces"', "tracing.otlp_endpoint: must include a host"),
        (
            'otlp_endpoint = "https://user:s3cret@collector:4318/v1/traces"',
            "tracing.otlp_endpoint: must not contain credentials (user:password@); use "
            "OTEL_EXPORTER_OTLP_HEADERS",
        ),
        ("sample_rate = 0.5", 'tracing.sample_rate: unknown key; did you mean "sample_ratio"?'),
    ],
)
def test_each_rule_names_its_key_path(table: str, error: str) -> None:
    assert errors_of(f"[tracing]\n{table}\n") == [error]


def test_an_error_never_echoes_the_endpoints_credentials() -> None:
    [error] = errors_of('[tracing]\notlp_endpoint = "https://u:hunter2@c:4318/v1/traces"\n')
    assert "hunter2" not in error


def test_environment_overrides_reach_the_table() -> None:
    env = {
        "SIDECAR__TRACING__SAMPLE_RATIO": "0.25",
        "SIDECAR__TRACING__PROPAGATE": "true",
        "SIDECAR__TRACING__OTLP_ENDPOINT": "http://otel-collector:4318/v1/traces",
    }
    tc = parse_config(BASE + "[tracing]\n", env).tracing
    assert tc is not None
    assert (tc.sample_ratio, tc.propagate, tc.otlp_endpoint) == (
        0.25,
        True,
        "http://otel-collector:4318/v1/traces",
    )


def test_the_effective_config_shows_the_table_and_loads_again() -> None:
    config = parse_config(BASE + '[tracing]\nsample_ratio = 0.1\nservice_name = "edge"\n', {})
    text = render_effective(config)
    assert "[tracing]" in text and 'service_name = "edge"' in text
    assert parse_config(text, {}) == config

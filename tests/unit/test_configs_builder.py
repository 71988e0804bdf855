"""The tests' one config builder (tests/configs.py): what it writes is what the keywords say,
and the sidecar's own parser reads it."""

from __future__ import annotations

import tomllib

import pytest

from sidecar.config import parse_config
from tests.configs import config, fallback, route, route_table, single, upstream


def test_single_is_one_upstream_under_one_route_and_parses() -> None:
    text = single(
        "http://127.0.0.1:1",
        server={"drain_timeout_ms": 200},
        retry={"max_retries": 2},
        circuit_breaker={"failure_threshold": 1},
        first_byte_timeout_ms=50,
    )
    assert tomllib.loads(text) == {
        "server": {"drain_timeout_ms": 200},
        "upstreams": {
            "primary": {
                "base_url": "http://127.0.0.1:1",
                "first_byte_timeout_ms": 50,
                "retry": {"max_retries": 2},
                "circuit_breaker": {"failure_threshold": 1},
            }
        },
        "routes": [
            {"name": "chat", "path_prefix": "/v1/", "candidates": [{"upstream": "primary"}]}
        ],
    }
    assert parse_config(text, {}).routes[0].name == "chat"


def test_fallback_is_primary_then_backup_under_one_route_and_parses() -> None:
    text = fallback(
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        primary={"retry": {"max_retries": 2}, "circuit_breaker": {"failure_threshold": 1}},
        backup={"max_connections": 1},
    )
    assert tomllib.loads(text) == {
        "upstreams": {
            "primary": {
                "base_url": "http://127.0.0.1:1",
                "retry": {"max_retries": 2},
                "circuit_breaker": {"failure_threshold": 1},
            },
            "backup": {"base_url": "http://127.0.0.1:2", "max_connections": 1},
        },
        "routes": [
            {
                "name": "chat",
                "path_prefix": "/v1/",
                "candidates": [{"upstream": "primary"}, {"upstream": "backup"}],
            }
        ],
    }
    assert [c.upstream for c in parse_config(text, {}).routes[0].candidates] == [
        "primary",
        "backup",
    ]


def test_candidates_by_name_or_table_and_an_empty_table_is_kept() -> None:
    text = config(
        upstreams={"a": upstream("http://x", circuit_breaker={}), "b": upstream("http://y")},
        routes=[route("r", {"upstream": "a", "model": "m"}, "b", models=["m"])],
    )
    doc = tomllib.loads(text)
    assert doc["upstreams"]["a"]["circuit_breaker"] == {}
    assert doc["routes"] == [
        {
            "name": "r",
            "models": ["m"],
            "candidates": [{"upstream": "a", "model": "m"}, {"upstream": "b"}],
        }
    ]


def test_a_value_is_quoted_and_escaped_by_the_toml_writer() -> None:
    odd = 'say "hi" \\ there'
    text = single("http://x", headers={"x-odd": odd})
    assert tomllib.loads(text)["upstreams"]["primary"]["headers"] == {"x-odd": odd}


def test_route_table_rows_give_one_upstream_and_route_each_in_order() -> None:
    doc = tomllib.loads(
        route_table("http://x", [("a", "/v1/", None), ("b", "/v1/", ["m"], {"h": "1"})])
    )
    assert doc["upstreams"] == {"up_a": {"base_url": "http://x"}, "up_b": {"base_url": "http://x"}}
    assert doc["routes"] == [
        {"name": "a", "path_prefix": "/v1/", "candidates": [{"upstream": "up_a"}]},
        {
            "name": "b",
            "path_prefix": "/v1/",
            "models": ["m"],
            "match_headers": {"h": "1"},
            "candidates": [{"upstream": "up_b"}],
        },
    ]


def test_extra_raw_toml_is_merged_and_a_key_set_twice_is_an_error() -> None:
    text = single("http://x", extra='[upstreams.primary]\nauth_header = "x-api-key"\n[admin]\n')
    doc = tomllib.loads(text)
    assert doc["upstreams"]["primary"]["auth_header"] == "x-api-key"
    assert doc["admin"] == {}
    with pytest.raises(ValueError, match=r"upstreams\.primary\.base_url"):
        single("http://x", extra='[upstreams.primary]\nbase_url = "http://y"\n')

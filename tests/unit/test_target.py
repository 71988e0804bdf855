"""``sidecar.target``: the request-line and ``Host`` checks the proxy makes on rare paths."""

from __future__ import annotations

import pytest

from sidecar.target import (
    has_dot_segment,
    only_chunked,
    path_readings,
    remove_dot_segments,
    valid_host,
)


@pytest.mark.parametrize(
    "host",
    ["", "api.example", "api.example:443", "127.0.0.1", "[::1]:8080", "[v1.x]", "a%20b", "h:"],
)
def test_valid_hosts(host: str) -> None:
    assert valid_host(host)


@pytest.mark.parametrize(
    "host", ["a b", "user@evil.example", "h:80:80", "h/x", "[::1", "caf\u00e9", "%zz", "h\t"]
)
def test_invalid_hosts(host: str) -> None:
    assert not valid_host(host)


@pytest.mark.parametrize(
    ("values", "ok"),
    [
        (["chunked"], True),
        (["Chunked "], True),
        (["gzip, chunked"], False),
        (["gzip", "chunked"], False),
        (["identity"], False),
        (["chunked, chunked"], False),
    ],
)
def test_only_chunked(values: list[str], ok: bool) -> None:
    assert only_chunked(values) is ok


@pytest.mark.parametrize(
    ("path", "resolved"),
    [  # RFC 3986 section 5.2.4's examples, and edges
        ("/a/b/c/./../../g", "/a/g"),
        ("/mid/content=5/../6", "/mid/6"),
        ("/v1/../admin/x", "/admin/x"),
        ("/../v1", "/v1"),
        ("/v1/x/..", "/v1/"),
        ("/v1/x/.", "/v1/x/"),
        ("/v1//../admin", "/v1/admin"),
        ("/v1/x", "/v1/x"),
    ],
)
def test_remove_dot_segments(path: str, resolved: str) -> None:
    assert remove_dot_segments(path) == resolved


def test_dot_segments_are_whole_segments() -> None:
    assert has_dot_segment("/v1/../x") and has_dot_segment("/v1/.")
    assert not has_dot_segment("/.well-known/x") and not has_dot_segment("/v1/..x")


def test_path_readings() -> None:
    assert path_readings("/v1//../admin", "/v1//../admin") == {
        "/v1//../admin",
        "/v1/admin",
        "/admin",
    }
    # %2F is a separator for routing (decoded), not for an upstream that keeps it
    assert path_readings("/v1/../admin", "/v1%2F..%2Fadmin") == {"/v1/../admin", "/admin"}
    assert path_readings("/v1/../x", "/v1/%2e%2e/x") == {"/v1/../x", "/x"}

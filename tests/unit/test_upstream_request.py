"""``UpstreamRequest`` builds exactly the request aiohttp's own ``ClientRequest`` builds.

The sidecar's session uses it to skip two per-request header rebuilds
(``sidecar.wire.upstream_request``); these tests pin that the headers, their order and
the skip map it leaves behind are the same as aiohttp's, for any header pairs,
so an aiohttp release that changes either side fails here by name.
"""

from __future__ import annotations

import asyncio
import inspect

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, istr
from yarl import URL

from sidecar.wire.upstream_request import (
    SKIP_AUTO_HEADERS,
    UpstreamRequest,
    proxied_request_class,
)

NAMES = st.sampled_from(
    ["Authorization", "content-type", "X-Trace", "x-trace", "Cookie", "Accept", "User-Agent"]
)
PAIRS = st.lists(st.tuples(NAMES, st.text("abc xyz/=;", max_size=8)), max_size=8)


def build(cls: type[aiohttp.ClientRequest], pairs: list[tuple[str, str]], body: bytes | None):  # type: ignore[no-untyped-def]
    loop = asyncio.new_event_loop()
    try:
        return cls(
            "POST",
            URL("http://127.0.0.1:8080/v1/chat/completions"),
            # What ClientSession._request hands the request class.
            headers=CIMultiDict(pairs),
            skip_auto_headers=frozenset(istr(h) for h in SKIP_AUTO_HEADERS),
            data=body,
            loop=loop,
        )
    finally:
        loop.close()


@given(pairs=PAIRS, body=st.sampled_from([None, b"", b'{"model":"m"}']))
def test_same_headers_and_skip_map_as_aiohttp(
    pairs: list[tuple[str, str]], body: bytes | None
) -> None:
    ours, theirs = build(UpstreamRequest, pairs, body), build(aiohttp.ClientRequest, pairs, body)
    assert list(ours.headers.items()) == list(theirs.headers.items())
    assert list(ours.skip_auto_headers.items()) == list(theirs.skip_auto_headers.items())


@pytest.mark.parametrize("host", ["Host", "host"])
def test_a_configured_host_header_takes_aiohttps_path(host: str) -> None:
    pairs = [("X-A", "1"), (host, "api.example"), ("X-B", "2")]
    ours, theirs = build(UpstreamRequest, pairs, None), build(aiohttp.ClientRequest, pairs, None)
    assert list(ours.headers.items()) == list(theirs.headers.items())


def test_the_overridden_steps_still_exist() -> None:
    for name in ("update_headers", "update_auto_headers"):
        assert getattr(UpstreamRequest, name) is not getattr(aiohttp.ClientRequest, name)
        assert f"self.{name}(" in inspect.getsource(aiohttp.ClientRequest.__init__)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_proxied_request_is_aiohttps_request_with_proxy_and_its_headers(scheme: str) -> None:
    """``proxied_request_class`` relies on ``ClientRequest.__init__`` calling
    ``update_proxy``: the request then holds what ``ClientSession(proxy=...,
    proxy_headers=...)`` would give it (the connector keys and tunnels by it)."""
    proxy, auth = URL("http://127.0.0.1:3128"), "Basic ZTpw"
    cls = proxied_request_class(proxy, auth)
    loop = asyncio.new_event_loop()
    try:
        req = cls(
            "POST",
            URL(f"{scheme}://127.0.0.1:8443/v1/x"),
            headers=CIMultiDict([("X-A", "1")]),
            skip_auto_headers=frozenset(istr(h) for h in SKIP_AUTO_HEADERS),
            data=b"{}",
            loop=loop,
        )
    finally:
        loop.close()
    assert req.proxy == proxy
    assert req.proxy_auth is None
    assert dict(req.proxy_headers or {}) == {"Proxy-Authorization": auth}  # on the CONNECT
    assert req.connection_key.proxy == proxy
    # No CONNECT for http: the proxy reads its credentials on the request itself.
    assert req.headers.get("Proxy-Authorization") == (auth if scheme == "http" else None)
    assert "proxy" in inspect.signature(aiohttp.ClientRequest.update_proxy).parameters

"""Header hygiene through the running sidecar, as the fake upstream and the client see it.

Hop-by-hop headers (and those named in ``Connection``) dropped both ways, ``Host``
rewritten to the upstream's, auth injection from ``api_key_env`` or client auth
passed through, configured ``headers`` set. Each test first checks, where it
matters, that the header really goes over the wire when sent directly (so the
assertion on the relayed request can fail).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from sidecar.testing import FakeUpstream, Fault
from tests.configs import single
from tests.conftest import StartSidecar

CHAT = "/v1/chat/completions"
KEY = "sk-test-injected-0123456789"


# One upstream ``primary`` under one route ``all`` (no path prefix), built by ``single``.
ALL: dict[str, Any] = {"route_name": "all", "path_prefix": None}
KEY_ENV = "TEST_UPSTREAM_KEY"


def request_hop_headers() -> CIMultiDict[str]:
    h: CIMultiDict[str] = CIMultiDict()
    h.add("Connection", "keep-alive, X-Hop-A")
    h.add("Connection", "x-hop-b")
    h.add("X-Hop-A", "a")
    h.add("X-Hop-B", "b")
    h.add("Keep-Alive", "timeout=5, max=100")
    h.add("TE", "trailers")
    h.add("Trailer", "X-Checksum")
    h.add("Upgrade", "websocket")
    h.add("Proxy-Authorization", "Basic cHJveHk6c2VjcmV0")
    h.add("Proxy-Connection", "keep-alive")
    h.add("X-End-To-End", "kept")
    h.add("X-Dup", "1")
    h.add("X-Dup", "2")
    return h


REQUEST_HOP = (
    "Connection",
    "X-Hop-A",
    "X-Hop-B",
    "Keep-Alive",
    "TE",
    "Trailer",
    "Upgrade",
    "Proxy-Authorization",
    "Proxy-Connection",
)


async def test_hop_by_hop_request_headers_are_dropped_and_host_is_the_upstreams(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(single(fake.url, **ALL))
    async with http.post(fake2.url + CHAT, json={"model": "m"}, headers=request_hop_headers()) as d:
        assert d.status == 200
    direct = fake2.requests[0].headers
    for name in REQUEST_HOP:
        assert name in direct, f"control: {name} did not reach the fake when sent directly"

    async with http.post(
        sc.proxy_url + CHAT, json={"model": "m"}, headers=request_hop_headers()
    ) as r:
        assert r.status == 200
        await r.read()
    got = fake.requests[0].headers
    for name in REQUEST_HOP:
        assert name not in got, f"{name} was relayed upstream"
    assert got.getall("Host") == [f"127.0.0.1:{fake.port}"]
    assert got["X-End-To-End"] == "kept"
    assert got.getall("X-Dup") == ["1", "2"]
    assert got["Content-Type"] == "application/json"


RESPONSE_HOP = {
    "Connection": "X-Resp-Hop, x-resp-hop-2",
    "X-Resp-Hop": "1",
    "X-Resp-Hop-2": "2",
    "Keep-Alive": "timeout=5",
    "Trailer": "X-Checksum",
    "Upgrade": "h2c",
    "Proxy-Authenticate": 'Basic realm="proxy"',
    "Proxy-Connection": "keep-alive",
    "X-End-To-End": "kept",
}


async def test_hop_by_hop_response_headers_are_dropped(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    fake.set_default(Fault(headers=RESPONSE_HOP))
    fake2.set_default(Fault(headers=RESPONSE_HOP))
    sc = await start_sidecar(single(fake.url, **ALL))
    async with http.post(fake2.url + CHAT, json={"model": "m"}) as d:
        for name in RESPONSE_HOP:
            assert name in d.headers, f"control: the fake did not send {name}"
        want = await d.read()
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200
        for name in ("X-Resp-Hop", "X-Resp-Hop-2", "Keep-Alive", "Trailer", "Upgrade"):
            assert name not in r.headers, f"{name} was relayed to the client"
        assert "Proxy-Authenticate" not in r.headers
        assert "Proxy-Connection" not in r.headers
        assert "x-resp-hop" not in r.headers.get("Connection", "").lower()
        assert r.headers["X-End-To-End"] == "kept"
        assert r.headers["x-fake-request"] == "1"
        assert len(await r.read()) == len(want)


async def test_hop_by_hop_response_headers_are_dropped_on_streams(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    fake.set_default(Fault(headers=RESPONSE_HOP))
    sc = await start_sidecar(single(fake.url, **ALL))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m", "stream": True}) as r:
        assert r.status == 200
        for name in ("X-Resp-Hop", "X-Resp-Hop-2", "Keep-Alive", "Trailer", "Upgrade"):
            assert name not in r.headers
        assert "Proxy-Authenticate" not in r.headers
        assert r.headers["X-End-To-End"] == "kept"
        assert (await r.read()).endswith(b"data: [DONE]\n\n")


CLIENT_CREDENTIALS = {
    "Authorization": "Bearer client-token",
    "X-API-Key": "client-x-api-key",
    "api-key": "client-api-key",
}


@pytest.mark.parametrize(
    ("auth_header", "name", "value"),
    [
        (None, "authorization", f"Bearer {KEY}"),
        ("authorization", "authorization", f"Bearer {KEY}"),
        ("Authorization", "authorization", f"Bearer {KEY}"),
        ("x-api-key", "x-api-key", KEY),
        ("api-key", "api-key", KEY),
        ("X-Goog-Api-Key", "x-goog-api-key", KEY),
    ],
)
async def test_api_key_env_replaces_every_client_credential(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    auth_header: str | None,
    name: str,
    value: str,
) -> None:
    keys: dict[str, Any] = {"api_key_env": KEY_ENV}
    if auth_header is not None:
        keys["auth_header"] = auth_header
    sc = await start_sidecar(single(fake.url, **ALL, **keys), environ={KEY_ENV: KEY})
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}, headers=CLIENT_CREDENTIALS) as r:
        assert r.status == 200
        await r.read()
    got = fake.requests[0].headers
    assert got.getall(name) == [value]
    for cred in ("authorization", "x-api-key", "api-key"):
        if cred != name:
            assert cred not in got, f"client credential {cred} was relayed"
    for client_value in CLIENT_CREDENTIALS.values():
        assert client_value not in str(list(got.items()))


async def test_api_key_is_injected_when_the_client_sends_no_credentials(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(single(fake.url, **ALL, api_key_env=KEY_ENV), environ={KEY_ENV: KEY})
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200
    assert fake.requests[0].headers.getall("Authorization") == [f"Bearer {KEY}"]


async def test_without_api_key_env_client_credentials_pass_through(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(single(fake.url, **ALL))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}, headers=CLIENT_CREDENTIALS) as r:
        assert r.status == 200
    got = fake.requests[0].headers
    for name, value in CLIENT_CREDENTIALS.items():
        assert got.getall(name) == [value]


async def test_configured_headers_are_set_on_every_upstream_request(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    headers = {"anthropic-version": "2023-06-01", "X-Org": "team-a"}
    sc = await start_sidecar(single(fake.url, **ALL, headers=headers))
    for client_headers in ({}, {"X-Org": "from-client", "anthropic-version": "1999-01-01"}):
        async with http.post(sc.proxy_url + CHAT, json={"model": "m"}, headers=client_headers) as r:
            assert r.status == 200
    assert fake.request_count == 2
    for rec in fake.requests:
        assert rec.headers.getall("anthropic-version") == ["2023-06-01"]
        assert rec.headers.getall("x-org") == ["team-a"]


async def test_configured_headers_and_injected_key_together(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    keys: dict[str, Any] = {
        "api_key_env": KEY_ENV,
        "auth_header": "x-api-key",
        "headers": {"anthropic-version": "2023-06-01"},
    }
    sc = await start_sidecar(single(fake.url, **ALL, **keys), environ={KEY_ENV: KEY})
    async with http.post(
        sc.proxy_url + "/v1/messages", json={"model": "m"}, headers=CLIENT_CREDENTIALS
    ) as r:
        assert r.status == 200
    got = fake.requests[0].headers
    assert got.getall("x-api-key") == [KEY]
    assert got.getall("anthropic-version") == ["2023-06-01"]
    assert "authorization" not in got
    assert "api-key" not in got


async def test_sidecar_headers_on_relayed_answers(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """``x-sidecar-*`` set by the sidecar replace any the upstream sent."""
    fake.set_default(Fault(headers={"x-sidecar-upstream": "spoofed", "x-sidecar-attempts": "99"}))
    sc = await start_sidecar(single(fake.url, **ALL))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers.getall("x-sidecar-upstream") == ["primary"]
        assert r.headers.getall("x-sidecar-attempts") == ["1"]


async def test_repeated_response_headers_are_all_relayed(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    repeated = CIMultiDict([("Set-Cookie", "a=1; Path=/"), ("Set-Cookie", "b=2"), ("X-Multi", "x")])
    fake.set_default(Fault(headers=repeated))
    sc = await start_sidecar(single(fake.url, **ALL))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers.getall("Set-Cookie") == ["a=1; Path=/", "b=2"]
        assert r.headers.getall("X-Multi") == ["x"]

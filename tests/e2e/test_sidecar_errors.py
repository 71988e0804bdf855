"""The sidecar's own error answers: status, ``code``, body shape and headers.

OpenAI's shape ``{"error": {"message", "type": code, "code": code}}`` everywhere
but ``/v1/messages``, which gets Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` with Anthropic's type for the status. Each answer carries
``x-sidecar-error`` and ``x-sidecar-attempts`` and never an upstream URL or key.
Also the request body limit (413), by Content-Length and chunked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from sidecar.testing import FakeClock, FakeUpstream, Fault, closed_port
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar, on_fake_time

KEY = "sk-never-shown-4242"
ANTHROPIC_TYPES = {
    503: "overloaded_error",
    502: "api_error",
    504: "api_error",
    404: "not_found_error",
    413: "request_too_large",
    400: "invalid_request_error",
}


# One upstream ``primary`` (its key from the environment, no retries) under route ``r``:
# ``config(server={}, upstreams={"primary": upstream(url, **PRIMARY)}, routes=[ROUTE])``.
PRIMARY: dict[str, Any] = {
    "api_key_env": "ERR_TEST_KEY",
    "first_byte_timeout_ms": 150,
    "retry": {"max_retries": 0},
}
ROUTE = route("r", "primary")


@dataclass
class Seen:
    status: int
    headers: CIMultiDict[str]
    body: bytes
    upstream_url: str


async def provoke(
    code: str,
    path: str,
    fake: FakeUpstream,
    start: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> Seen:
    """Make the sidecar answer with its own error ``code`` on ``path``."""
    env = {"ERR_TEST_KEY": KEY}
    url = fake.url
    data = b'{"model": "m", "messages": []}'
    if code == "no_route":
        sc = await start(
            config(
                server={},
                upstreams={"primary": upstream(url, **PRIMARY)},
                routes=[route("r", "primary", path_prefix="/nowhere/")],
            ),
            environ=env,
        )
    elif code == "bad_request":
        sc = await start(
            config(
                server={},
                upstreams={"primary": upstream(url, **PRIMARY)},
                routes=[route("r", "primary", models=["m"])],
            ),
            environ=env,
        )
        data = b"this is not json"
    elif code == "request_too_large":
        sc = await start(
            config(
                server={"max_request_body_bytes": 16},
                upstreams={"primary": upstream(url, **PRIMARY)},
                routes=[ROUTE],
            ),
            environ=env,
        )
    elif code == "upstream_unavailable":
        url = f"http://127.0.0.1:{closed_port()}"
        sc = await start(
            config(server={}, upstreams={"primary": upstream(url, **PRIMARY)}, routes=[ROUTE]),
            environ=env,
        )
    elif code == "upstream_timeout":
        fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
        sc = await start(
            config(server={}, upstreams={"primary": upstream(url, **PRIMARY)}, routes=[ROUTE]),
            environ=env,
        )
    elif code == "circuit_open":
        fake.set_default(Fault(status=503))
        cb = {"failure_threshold": 1, "cooldown_ms": 30000}
        primary = upstream(url, **PRIMARY, circuit_breaker=cb)
        sc = await start(
            config(server={}, upstreams={"primary": primary}, routes=[ROUTE]), environ=env
        )
        async with http.post(sc.proxy_url + path, data=data) as first:
            assert first.status == 503  # the upstream's own 503, relayed; the breaker opens
            assert "x-sidecar-error" not in first.headers
    else:  # pragma: no cover
        raise AssertionError(code)

    async def answer() -> Seen:
        async with http.post(sc.proxy_url + path, data=data) as r:
            return Seen(r.status, CIMultiDict(r.headers), await r.read(), url)

    # The first-byte timeout (150 ms) runs on the fake clock, advanced once the fake holds it.
    return await on_fake_time(
        clock, fake, [(1, 0.15)] if code == "upstream_timeout" else [], answer()
    )


CASES = [
    ("no_route", 404, 0),
    ("bad_request", 400, 0),
    ("request_too_large", 413, 0),
    ("upstream_unavailable", 502, 1),
    ("upstream_timeout", 504, 1),
    ("circuit_open", 503, 0),
]


@pytest.mark.parametrize(("code", "status", "attempts"), CASES)
async def test_openai_shape(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    code: str,
    status: int,
    attempts: int,
) -> None:
    seen = await provoke(code, "/v1/chat/completions", fake, start_sidecar, http, clock)
    assert seen.status == status
    assert seen.headers["x-sidecar-error"] == code
    assert seen.headers["x-sidecar-attempts"] == str(attempts)
    assert seen.headers["Content-Type"].startswith("application/json")
    doc = json.loads(seen.body)
    assert set(doc) == {"error"}
    assert doc["error"]["type"] == code
    assert doc["error"]["code"] == code
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    assert_nothing_leaks(seen)


@pytest.mark.parametrize(("code", "status", "attempts"), CASES)
async def test_anthropic_shape_on_v1_messages(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    code: str,
    status: int,
    attempts: int,
) -> None:
    seen = await provoke(code, "/v1/messages", fake, start_sidecar, http, clock)
    assert seen.status == status
    assert seen.headers["x-sidecar-error"] == code
    assert seen.headers["x-sidecar-attempts"] == str(attempts)
    doc = json.loads(seen.body)
    assert doc["type"] == "error"
    assert doc["error"]["type"] == ANTHROPIC_TYPES[status]
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    assert_nothing_leaks(seen)


def assert_nothing_leaks(seen: Seen) -> None:
    text = seen.body.decode() + repr(seen.headers)
    host_port = seen.upstream_url.removeprefix("http://")
    assert host_port not in text
    assert KEY not in text
    assert '"messages"' not in text


async def test_circuit_open_has_retry_after(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession, clock: FakeClock
) -> None:
    seen = await provoke("circuit_open", "/v1/chat/completions", fake, start_sidecar, http, clock)
    assert seen.headers["Retry-After"] == "30"
    assert fake.request_count == 1


# -- the request body limit ---------------------------------------------------------


def limited(url: str, limit: int) -> str:
    return config(
        server={"max_request_body_bytes": limit},
        upstreams={"primary": upstream(url, **PRIMARY)},
        routes=[ROUTE],
    )


async def test_body_over_the_limit_by_content_length_is_413(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(limited(fake.url, 1000), environ={"ERR_TEST_KEY": KEY})
    async with http.post(sc.proxy_url + "/v1/embeddings", data=b"x" * 1001) as r:
        assert r.status == 413
        assert r.headers["x-sidecar-error"] == "request_too_large"
        assert r.headers.get("Connection", "").lower() == "close"
        assert (await r.json())["error"]["code"] == "request_too_large"
    assert fake.request_count == 0


async def test_body_at_the_limit_passes(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(limited(fake.url, 1000), environ={"ERR_TEST_KEY": KEY})
    body = b"y" * 1000
    async with http.post(sc.proxy_url + "/echo/x", data=body) as r:
        assert r.status == 200
    assert fake.requests[0].body == body


async def test_chunked_body_over_the_limit_is_413(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(limited(fake.url, 1000), environ={"ERR_TEST_KEY": KEY})

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"z" * 300

    async with http.post(sc.proxy_url + "/v1/embeddings", data=chunks()) as r:
        assert r.request_info.headers.get("Transfer-Encoding") == "chunked"
        assert r.status == 413
        assert r.headers["x-sidecar-error"] == "request_too_large"
        assert (await r.json())["error"]["code"] == "request_too_large"
    assert fake.request_count == 0


async def test_chunked_body_at_the_limit_passes(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(limited(fake.url, 1000), environ={"ERR_TEST_KEY": KEY})

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"w" * 250

    async with http.post(sc.proxy_url + "/echo/x", data=chunks()) as r:
        assert r.status == 200
    assert fake.requests[0].body == b"w" * 1000

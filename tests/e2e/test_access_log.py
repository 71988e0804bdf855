"""The access log through the running sidecar: one exact ``request`` line per request.

Contract, "Logs": with ``access_log`` on (the default) every proxied request ends
with one JSON line, ``event`` = ``request``, fields ``route``, ``method``, ``path``
(never the query string), ``status``, ``upstream``, ``attempts``, ``fallbacks``,
``duration_ms``, ``first_byte_ms``, ``outcome``, ``error``. Lines are read as the
log handler writes them, and times are on the FakeClock, so every field is
asserted exactly. Cuts (mid-stream, a client leaving) and ``overloaded`` are in
``test_access_log_cuts.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import aiohttp
import pytest

from sidecar.testing import FakeClock, FakeUpstream, Fault, closed_port
from tests.access_log_helpers import CHAT, Lines, access_config, capture, line, post, without_ts
from tests.conftest import StartSidecar, on_fake_time


@pytest.fixture
def access() -> Iterator[Lines]:
    yield from capture()


async def test_success_retry_fallback_and_relayed_errors(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
) -> None:
    sc = await start_sidecar(access_config(fake.url, fake2.url))
    url = sc.proxy_url + CHAT
    assert await post(http, url) == 200
    fake.script([Fault(status=503), Fault(status=503)])  # retried once, then the backup
    assert await post(http, url) == 200
    fake.script([Fault(status=422)])  # the caller's: relayed at once
    assert await post(http, url) == 422
    fake.script([Fault(status=503)] * 2)
    fake2.script([Fault(status=503)])  # the last candidate's failing answer, relayed
    assert await post(http, url) == 503
    # The fake's chat.completion reports 10 prompt and 5 completion tokens, no cache.
    tokens = {"input_tokens": 10, "output_tokens": 5}
    assert without_ts(await access.wait(4)) == [
        line(**tokens),
        line(  # a success after failed attempts keeps the last one's cause
            upstream="backup",
            attempts=3,
            fallbacks=1,
            duration_ms=10.0,
            first_byte_ms=10.0,
            upstream_error="http_503",
            **tokens,
        ),
        line(status=422, outcome="caller_error"),
        line(
            status=503,
            upstream="backup",
            attempts=3,
            fallbacks=1,
            duration_ms=10.0,
            first_byte_ms=10.0,
            outcome="upstream_error",
            upstream_error="http_503",
        ),
    ]


async def test_the_sidecars_own_502_and_504(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    access: Lines,
) -> None:
    dead = await start_sidecar(access_config(f"http://127.0.0.1:{closed_port()}"))
    assert await post(http, dead.proxy_url + CHAT) == 502
    silent = await start_sidecar(access_config(fake.url, first_byte_timeout_ms=150))
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
    answer = post(http, silent.proxy_url + CHAT)
    assert await on_fake_time(clock, fake, [(1, 0.15)], answer) == 504
    assert without_ts(await access.wait(2)) == [
        line(
            status=502,
            upstream=None,
            attempts=2,
            duration_ms=10.0,
            first_byte_ms=None,
            outcome="upstream_error",
            error="upstream_unavailable",
            upstream_error="refused",
        ),
        line(
            status=504,
            upstream=None,
            duration_ms=150.0,
            first_byte_ms=None,
            outcome="upstream_error",
            error="upstream_timeout",
            upstream_error="timeout",
        ),
    ]


async def test_circuit_open(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
) -> None:
    breaker = {"failure_threshold": 1, "cooldown_ms": 60000}
    sc = await start_sidecar(access_config(fake.url, circuit_breaker=breaker))
    fake.set_default(Fault(status=503))
    assert await post(http, sc.proxy_url + CHAT) == 503  # relayed; the breaker opens
    assert await post(http, sc.proxy_url + CHAT) == 503  # skipped: circuit_open
    lines = without_ts(await access.wait(2))
    assert lines[1] == line(
        status=503,
        upstream=None,
        attempts=0,
        first_byte_ms=None,
        outcome="circuit_open",
        error="circuit_open",
    )
    assert lines[0]["upstream_error"] == "http_503"
    assert fake.request_count == 2


async def test_refusals_before_a_route_is_chosen_have_a_null_route(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
) -> None:
    sc = await start_sidecar(access_config(fake.url, server={"max_request_body_bytes": 64}))
    assert await post(http, sc.proxy_url + "/nowhere") == 404
    assert await post(http, sc.proxy_url + CHAT, data=b"x" * 65) == 413
    assert await post(http, sc.proxy_url + "/strict/x", data=b"not json") == 400
    refused = {"route": None, "upstream": None, "attempts": 0, "first_byte_ms": None}
    assert without_ts(await access.wait(3)) == [
        line(**refused, path="/nowhere", status=404, outcome="rejected", error="no_route"),
        line(**refused, status=413, outcome="rejected", error="request_too_large"),
        line(**refused, path="/strict/x", status=400, outcome="rejected", error="bad_request"),
    ]
    assert fake.request_count == 0


async def test_access_log_false_writes_no_line(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    sc = await start_sidecar(access_config(fake.url, server={"access_log": False}))
    assert await post(http, sc.proxy_url + CHAT) == 200
    assert await post(http, sc.proxy_url + "/nowhere") == 404
    fake.script([Fault(reset_after_chunks=2)])
    async with http.post(sc.proxy_url + CHAT, json={"model": "m", "stream": True}) as r:
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    assert await post(http, sc.proxy_url + CHAT) == 200  # its handler ended: so had the others
    await asyncio.sleep(0)
    assert access.text == []
    assert not [r for r in caplog.records if r.getMessage() == "request"]


async def test_the_query_string_never_appears(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
) -> None:
    canary = "sk-query-canary-31c9e0"
    sc = await start_sidecar(access_config(fake.url))
    url = f"{sc.proxy_url}{CHAT}?key={canary}&x=1"
    assert await post(http, url, headers={"Authorization": f"Bearer {canary}"}) == 200
    assert await post(http, f"{sc.proxy_url}/nowhere?key={canary}") == 404
    lines = await access.wait(2)
    assert [got["path"] for got in lines] == [CHAT, "/nowhere"]
    assert fake.requests[0].query_string == f"key={canary}&x=1"  # relayed upstream, not logged
    for text in access.text:
        assert canary not in text
        assert "?" not in text

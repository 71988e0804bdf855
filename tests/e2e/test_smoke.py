"""Quick end-to-end checks of the relay (lead's smoke tests)."""

from __future__ import annotations

import aiohttp
import pytest

from sidecar.testing import FakeClock, FakeUpstream, Fault, closed_port
from tests.configs import fallback
from tests.conftest import StartSidecar, status

PRIMARY = {"retry": {"max_retries": 2, "backoff_initial_ms": 10}}
"""``primary``'s keys: 2 retries, 10 ms backoff."""


async def test_json_relay(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(fallback(fake.url, fake2.url, primary=PRIMARY))
    body = b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}'
    async with http.post(fake.url + "/v1/chat/completions", data=body) as direct:
        direct_body = await direct.read()
    async with http.post(sc.proxy_url + "/v1/chat/completions", data=body) as r:
        assert r.status == 200
        got = await r.read()
        assert r.headers["x-sidecar-upstream"] == "primary"
        assert r.headers["x-sidecar-attempts"] == "1"
    assert len(got) == len(direct_body)
    assert fake.requests[-1].body == body


async def test_retry_then_fallback(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(fallback(fake.url, fake2.url, primary=PRIMARY))
    fake.set_default(Fault(status=503))
    async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "backup"
        assert r.headers["x-sidecar-attempts"] == "4"
    assert fake.request_count == 3
    assert fake2.request_count == 1


async def test_connect_refused_fallback(
    fake2: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(
        fallback(f"http://127.0.0.1:{closed_port()}", fake2.url, primary=PRIMARY)
    )
    async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-attempts"] == "4"


async def test_all_fail_502(start_sidecar: StartSidecar, http: aiohttp.ClientSession) -> None:
    p = closed_port()
    sc = await start_sidecar(
        fallback(f"http://127.0.0.1:{p}", f"http://127.0.0.1:{p}", primary=PRIMARY)
    )
    async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "upstream_unavailable"
        assert r.headers["x-sidecar-attempts"] == "6"


async def test_breaker_opens_and_skips(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    breaker = {"failure_threshold": 2, "cooldown_ms": 1000}
    sc = await start_sidecar(
        fallback(fake.url, fake2.url, primary={**PRIMARY, "circuit_breaker": breaker})
    )
    fake.set_default(Fault(status=503))
    for _ in range(2):
        async with http.post(sc.proxy_url + "/v1/x", json={"model": "m"}) as r:
            assert r.status == 200
    assert (await status(http, sc))["primary/*"]["state"] == "open"
    before = fake.connections_accepted
    async with http.post(sc.proxy_url + "/v1/x", json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-attempts"] == "1"
    assert fake.connections_accepted == before
    clock.advance(1.0)
    assert (await status(http, sc))["primary/*"]["state"] == "half_open"
    fake.set_default(Fault())
    async with http.post(sc.proxy_url + "/v1/x", json={"model": "m"}) as r:
        assert r.headers["x-sidecar-upstream"] == "primary"
    assert (await status(http, sc))["primary/*"]["state"] == "closed"


async def test_midstream_cut_aborts_client(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(fallback(fake.url, fake2.url, primary=PRIMARY))
    fake.set_default(Fault(reset_after_chunks=2))
    async with http.post(
        sc.proxy_url + "/v1/chat/completions", json={"model": "m", "stream": True}
    ) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    assert fake2.request_count == 0

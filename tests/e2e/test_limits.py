"""Limits: ``server.max_concurrent_requests`` and per-upstream ``max_connections``.

Requests are held at the fake upstream by an :class:`asyncio.Event` gate, so the
number in flight is exact; nothing waits on the wall clock.
"""

from __future__ import annotations

import asyncio

import aiohttp

from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream, Fault
from tests.configs import single
from tests.conftest import StartSidecar, metric

WAIT_S = 5.0
CHAT = "/v1/chat/completions"


SERVER = {"max_concurrent_requests": 1024}


async def post(http: aiohttp.ClientSession, sc: Sidecar) -> tuple[int, str | None, bytes]:
    async with http.post(sc.proxy_url + CHAT, json={"model": "gpt-4o"}) as r:
        return r.status, r.headers.get("x-sidecar-error"), await r.read()


async def inflight_reaches(http: aiohttp.ClientSession, sc: Sidecar, n: int) -> None:
    """Scrape ``sidecar_inflight_requests`` until it shows ``n`` (at most 500 scrapes, WAIT_S)."""
    async with asyncio.timeout(WAIT_S):
        for _ in range(500):
            if await metric(http, sc, "sidecar_inflight_requests") == n:
                return
    raise AssertionError(f"sidecar_inflight_requests never reached {n}")


async def test_past_max_concurrent_requests_is_503_overloaded_at_once_never_queued(
    fake: FakeUpstream, start_sidecar: StartSidecar
) -> None:
    sc = await start_sidecar(
        single(fake.url, server={"max_concurrent_requests": 2}, max_connections=256)
    )
    gate = asyncio.Event()
    fake.set_default(Fault(hold_headers=gate))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        # Metrics are process-wide: count this test's refusals as a difference.
        refused_before = await metric(http, sc, "sidecar_requests_total", route="", code="503")
        held = [asyncio.create_task(post(http, sc)) for _ in range(2)]
        async with asyncio.timeout(WAIT_S):
            await fake.wait_until(lambda: fake.active_requests == 2)

        # While two are held: every further request is refused at once (the gate is
        # still closed, so an answer at all proves it was not queued behind them).
        for _ in range(3):
            async with asyncio.timeout(WAIT_S):
                status, code, body = await post(http, sc)
            assert (status, code) == (503, "overloaded")
            assert b'"overloaded"' in body
        assert fake.request_count == 2
        assert not any(t.done() for t in held)

        gate.set()
        async with asyncio.timeout(WAIT_S):
            results = await asyncio.gather(*held)
        assert [r[0] for r in results] == [200, 200]
        # Capacity is back once they finished.
        assert (await post(http, sc))[0] == 200
        refused = await metric(http, sc, "sidecar_requests_total", route="", code="503")
        assert refused - refused_before == 3


async def test_max_connections_caps_open_upstream_connections(
    fake: FakeUpstream, start_sidecar: StartSidecar
) -> None:
    """max_connections = 2 with 5 concurrent held requests: the fake never sees a third."""
    sc = await start_sidecar(single(fake.url, server=SERVER, max_connections=2))
    gate = asyncio.Event()
    fake.set_default(Fault(hold_headers=gate))
    most_open = 0

    def note() -> bool:
        nonlocal most_open
        most_open = max(most_open, fake.open_connections)
        return False  # never satisfied: only watches every change of the fake's state

    watcher = asyncio.create_task(fake.wait_until(note))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [asyncio.create_task(post(http, sc)) for _ in range(5)]
        async with asyncio.timeout(WAIT_S):
            await fake.wait_until(lambda: fake.active_requests == 2)
        await inflight_reaches(http, sc, 5)  # all five are in the sidecar, three wait for a slot
        assert fake.open_connections == 2
        assert fake.request_count == 2

        gate.set()
        async with asyncio.timeout(WAIT_S):
            results = await asyncio.gather(*tasks)
    watcher.cancel()
    assert [r[0] for r in results] == [200] * 5
    assert fake.request_count == 5
    assert most_open == 2
    assert fake.connections_accepted == 2  # the queued three reused the two

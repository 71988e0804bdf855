"""The client's own deadline, through the running sidecar.

Contract, "Bounding the load that failures add": the time until the commit point is
bounded by the smallest of ``request_timeout_ms`` and each timeout the request announces
(``x-stainless-read-timeout``, ``x-stainless-timeout``, ``x-sidecar-timeout-ms``) less
5 % (at least 100 ms less), so that the client gets the sidecar's 504
``upstream_timeout`` with ``x-should-retry: false`` before it gives up and retries.

On the FakeClock: the deadline is shown to be neither later (a stalled upstream gets the
504 when the clock reaches it) nor sooner (an answer let go just before it is relayed).
With the real clock and the official ``openai`` SDK at ``timeout=2``: one SDK call, the
sidecar's 504 before the SDK's own timeout, no SDK retry, one upstream attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
import openai
import pytest

from sidecar.clock import LoopClock
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.configs import fallback, single
from tests.conftest import StartSidecar, metric, on_fake_time

CHAT = "/v1/chat/completions"
BODY: Any = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# headers, server keys -> seconds from arrival to the sidecar's 504
DEADLINES: list[tuple[dict[str, str], dict[str, Any], float]] = [
    ({"x-stainless-read-timeout": "10"}, {}, 9.5),  # 5 % of 10 s
    ({"x-stainless-read-timeout": "2.0"}, {}, 1.9),  # 5 % = 100 ms
    ({"x-stainless-timeout": "1"}, {}, 0.9),  # at least 100 ms
    ({"x-sidecar-timeout-ms": "4000"}, {}, 3.8),
    # the smallest announced one wins
    ({"x-stainless-read-timeout": "600", "x-stainless-timeout": "20"}, {}, 19.0),
    # request_timeout_ms when it is smaller
    ({"x-stainless-read-timeout": "600"}, {"request_timeout_ms": 3000}, 3.0),
    # an invalid value is ignored: request_timeout_ms applies
    ({"x-stainless-read-timeout": "soon"}, {"request_timeout_ms": 3000}, 3.0),
]


@pytest.mark.parametrize(("headers", "server", "deadline"), DEADLINES)
async def test_the_announced_timeout_less_its_margin_bounds_the_request(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    headers: dict[str, str],
    server: Mapping[str, Any],
    deadline: float,
) -> None:
    sc = await start_sidecar(single(fake.url, server=dict(server)))
    url = sc.proxy_url + CHAT

    # Not sooner: an answer let go 10 ms before the deadline is relayed.
    gate = asyncio.Event()
    fake.script([Fault(hold_headers=gate)])

    async def held() -> int:
        async with http.post(url, json=BODY, headers=headers) as r:
            await r.read()
            return r.status

    task = asyncio.ensure_future(held())
    async with asyncio.timeout(10):
        await fake.wait_for_requests(1)
    clock.advance(deadline - 0.01)
    gate.set()
    async with asyncio.timeout(10):
        assert await task == 200

    # Not later: a stalled upstream gets the sidecar's 504 at the deadline.
    fake.script([Fault(stall=True)])

    async def stalled() -> tuple[int, Mapping[str, str]]:
        async with http.post(url, json=BODY, headers=headers) as r:
            await r.read()
            return r.status, r.headers

    code, got = await on_fake_time(clock, fake, [(2, deadline)], stalled())
    assert code == 504
    assert got["x-sidecar-error"] == "upstream_timeout"
    assert got["x-should-retry"] == "false"
    assert got["x-sidecar-attempts"] == "1"
    assert fake.request_count == 2
    for q in fake.requests:  # relayed upstream as received
        for name, value in headers.items():
            assert q.headers[name] == value


async def test_the_client_deadline_bounds_retries_and_fallbacks_too(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """A first-byte timeout on the primary moves on to the backup, which stalls: the 504
    comes at the client's deadline, counted from the request's arrival."""
    sc = await start_sidecar(fallback(fake.url, fake2.url, primary={"first_byte_timeout_ms": 1000}))
    fake.set_default(Fault(stall=True))
    fake2.set_default(Fault(stall=True))

    async def call() -> tuple[int, str]:
        headers = {"x-stainless-read-timeout": "3"}  # 2.85 s
        async with http.post(sc.proxy_url + CHAT, json=BODY, headers=headers) as r:
            return r.status, r.headers["x-sidecar-attempts"]

    task = asyncio.ensure_future(call())
    async with asyncio.timeout(10):
        await fake.wait_for_requests(1)
    clock.advance(1.0)  # the primary's first-byte timeout: on to the backup
    async with asyncio.timeout(10):
        await fake2.wait_for_requests(1)
    clock.advance(1.84)
    assert not task.done()
    clock.advance(0.01)
    async with asyncio.timeout(10):
        assert await task == (504, "2")


@pytest.mark.timeout(20)
async def test_openai_sdk_gets_the_504_before_its_own_timeout_and_does_not_retry(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """The official SDK at ``timeout=2`` (its retries left at the default, 2) against an
    upstream that stalls: the sidecar answers 504 at 1.9 s after the request came, with
    ``x-should-retry: false``; the SDK raises it at once (no ``APITimeoutError``, no
    retry), and the upstream saw one attempt. Real clock: the margins are the
    contract's 100 ms on one side and the 1.9 s itself on the other; an SDK timeout
    would show as ``APITimeoutError`` after retries, not as the 504."""
    sc = await start_sidecar(
        single(fake.url, retry={"max_retries": 2, "retry_on_timeout": True}),
        clock_=LoopClock(),
    )
    fake.set_default(Fault(stall=True))
    client = openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key="k", timeout=2)
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []

    async def upstream_got_it() -> None:
        await fake.wait_for_requests(1)
        sent_at.append(loop.time())

    watch = asyncio.ensure_future(upstream_got_it())
    try:
        with pytest.raises(openai.InternalServerError) as raised:
            await client.chat.completions.create(model="m", messages=BODY["messages"])
        took = loop.time() - sent_at[0]
    finally:
        watch.cancel()
        await client.close()
    assert raised.value.status_code == 504
    response = raised.value.response
    assert response.headers["x-sidecar-error"] == "upstream_timeout"
    assert response.headers["x-should-retry"] == "false"
    # From when the request reached the upstream (after the SDK had sent it, so after
    # the SDK's 2 s began) to the SDK's exception: the sidecar's 1.9 s, not the SDK's 2 s.
    assert 1.5 < took < 2.0
    assert fake.request_count == 1  # one SDK call, one upstream attempt
    assert float(fake.requests[0].headers["x-stainless-read-timeout"]) == 2.0
    assert fake.requests[0].headers["x-stainless-retry-count"] == "0"
    assert await metric(http, sc, "sidecar_requests_total", route="chat", code="504") >= 1


@pytest.mark.parametrize(
    "headers", [{"x-sidecar-timeout-ms": "100"}, {"x-stainless-timeout": "0.05"}]
)
async def test_a_timeout_within_the_margin_is_answered_at_once(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    headers: dict[str, str],
) -> None:
    """100 ms or less leaves no time after the margin: 504 at once, no upstream call."""
    sc = await start_sidecar(single(fake.url))
    async with http.post(sc.proxy_url + CHAT, json=BODY, headers=headers) as r:
        assert r.status == 504
        assert r.headers["x-sidecar-error"] == "upstream_timeout"
        assert r.headers["x-should-retry"] == "false"
        assert r.headers["x-sidecar-attempts"] == "0"
    assert fake.request_count == 0

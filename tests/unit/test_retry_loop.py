"""The retry and fallback loop of :mod:`sidecar.proxy`, against upstream answers scripted
with aioresponses (no sockets): status sequences, connect errors, resets, timeouts.

The loop is driven directly (``Proxy._candidates``) on a fake clock, so backoff waits
and breaker time cost nothing; end-to-end behaviour is in ``tests/e2e``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from sidecar.config import parse_config
from sidecar.exchange import Exchange
from sidecar.generation import Generation, Runtime
from sidecar.metrics import Recorder
from sidecar.outcome import UpstreamConnectError, UpstreamResetError, UpstreamTimeout
from sidecar.proxy import Proxy
from sidecar.testing import FakeClock
from sidecar.testing.scripted import scripted_upstreams
from tests.configs import config, route, upstream

A, B = "http://a.test", "http://b.test"
CHAT = "/v1/chat/completions"
CONFIG = config(
    upstreams={
        "a": upstream(
            A,
            retry={
                "max_retries": 2,
                "backoff_initial_ms": 100,
                "backoff_max_ms": 150,
                "jitter": False,  # the waits are the schedule itself
            },
            circuit_breaker={"failure_threshold": 1},
        ),
        "b": upstream(B),
    },
    routes=[route("chat", "a", "b", path_prefix="/v1/")],
)


@pytest.fixture
async def loop_under_test() -> AsyncIterator[tuple[Proxy, Generation, FakeClock]]:
    clock = FakeClock()
    gen = Generation(parse_config(CONFIG, {}), {}, clock)
    await gen.start()
    try:
        yield Proxy(Runtime(gen), Recorder()), gen, clock
    finally:
        await gen.close()


async def run(proxy: Proxy, gen: Generation, clock: FakeClock) -> tuple[object, Exchange]:
    request = make_mocked_request("POST", CHAT, headers={"Host": "sidecar"})
    task = asyncio.current_task()
    assert task is not None
    ex = Exchange(clock, task, clock.now())
    route = gen.routes.routes[0]
    try:
        result = await proxy._candidates(request, gen, route, b'{"model":"m"}', ex)
    finally:
        ex.close()
    if isinstance(result, tuple):
        result[0].release()
        return result[0].status, ex
    return result, ex


async def test_retryable_statuses_are_retried_with_the_backoff_schedule(
    loop_under_test: tuple[Proxy, Generation, FakeClock],
) -> None:
    proxy, gen, clock = loop_under_test
    with scripted_upstreams() as m:
        m.post(A + CHAT, status=503)
        m.post(A + CHAT, status=502)
        m.post(A + CHAT, status=200, body=b"{}")
        status, ex = await run(proxy, gen, clock)
    assert (status, ex.attempts, ex.fallbacks) == (200, 3, 0)
    assert clock.sleeps == [0.1, 0.15]  # backoff_initial_ms doubling, capped at backoff_max_ms


async def test_retry_after_is_the_wait_and_a_too_long_one_falls_back_at_once(
    loop_under_test: tuple[Proxy, Generation, FakeClock],
) -> None:
    proxy, gen, clock = loop_under_test
    with scripted_upstreams() as m:
        m.post(A + CHAT, status=429, headers={"Retry-After": "2"})
        m.post(A + CHAT, status=429, headers={"Retry-After": "3600"})
        m.post(B + CHAT, status=200, body=b"{}")
        status, ex = await run(proxy, gen, clock)
    assert (status, ex.attempts, ex.fallbacks) == (200, 3, 1)
    assert clock.sleeps == [2.0]


@pytest.mark.parametrize(
    ("error", "attempts_on_a"),
    [
        (
            aiohttp.ClientConnectorError(
                aiohttp.client_reqrep.ConnectionKey("a.test", 80, False, True, None, None, None),
                OSError(111, "refused"),
            ),
            3,
        ),
        (aiohttp.ServerDisconnectedError(), 3),
        (aiohttp.ServerTimeoutError(), 1),  # a timeout is not retried by default
    ],
    ids=["connect_error", "reset", "timeout"],
)
async def test_transport_failures_retry_then_fall_back(
    loop_under_test: tuple[Proxy, Generation, FakeClock],
    error: Exception,
    attempts_on_a: int,
) -> None:
    proxy, gen, clock = loop_under_test
    with scripted_upstreams() as m:
        for _ in range(attempts_on_a):
            m.post(A + CHAT, exception=error)
        m.post(B + CHAT, status=200, body=b"{}")
        status, ex = await run(proxy, gen, clock)
    assert (status, ex.attempts, ex.fallbacks) == (200, attempts_on_a + 1, 1)
    # The failure counted once for a's breaker (threshold 1): it is open now.
    state = dict(gen.breakers.states()).get(gen.routes.routes[0].candidates[0].target)
    assert state is not None and state.state.value == "open"


async def test_the_last_transport_failure_is_the_result_when_every_candidate_fails(
    loop_under_test: tuple[Proxy, Generation, FakeClock],
) -> None:
    proxy, gen, clock = loop_under_test
    with scripted_upstreams() as m:
        for _ in range(3):
            m.post(A + CHAT, exception=aiohttp.ServerDisconnectedError())
        for _ in range(3):
            m.post(B + CHAT, exception=aiohttp.ServerTimeoutError())
        result, ex = await run(proxy, gen, clock)
    assert isinstance(result, UpstreamTimeout) and ex.attempts == 4
    assert not isinstance(result, UpstreamConnectError | UpstreamResetError)


async def test_a_callers_answer_is_final(
    loop_under_test: tuple[Proxy, Generation, FakeClock],
) -> None:
    proxy, gen, clock = loop_under_test
    with scripted_upstreams() as m:
        m.post(A + CHAT, status=400, body=b'{"error":{}}')
        status, ex = await run(proxy, gen, clock)
    assert (status, ex.attempts, ex.fallbacks, clock.sleeps) == (400, 1, 0, [])


async def test_an_open_breaker_skips_its_candidate_without_a_request(
    loop_under_test: tuple[Proxy, Generation, FakeClock],
) -> None:
    proxy, gen, clock = loop_under_test
    with scripted_upstreams() as m:
        for _ in range(3):
            m.post(A + CHAT, status=500)
        m.post(B + CHAT, status=200, body=b"{}")
        m.post(B + CHAT, status=200, body=b"{}")
        await run(proxy, gen, clock)  # a fails 3 times: its breaker opens
        status, ex = await run(proxy, gen, clock)
    assert (status, ex.attempts, ex.fallbacks) == (200, 1, 1)

"""Failures before and after the commit point, through the running sidecar.

Retries and ordered fallback with exact attempt counts at each fake and in
``x-sidecar-attempts``; backoff and ``Retry-After`` on the FakeClock;
first-byte timeouts; resets before the first chunk (retried invisibly) and
after it (the client is aborted, no fallback); connect refused / timed out;
the request deadline; the caller's 4xx and the last candidate's error relayed
as they came.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from sidecar.clock import LoopClock
from sidecar.testing import FakeClock, FakeUpstream, Fault, closed_port, saturated_listener
from tests import configs
from tests.conftest import StartSidecar, on_fake_time

CHAT = "/v1/chat/completions"
GOOD = b'{"id":"good","choices":[{"message":{"content":"the good answer"}}]}'


FAST = {"backoff_initial_ms": 10, "backoff_max_ms": 1000, "jitter": False}
"""The retry backoff (ms) every upstream here has unless ``retry`` says otherwise; no
jitter, so the waits are the exponential schedule itself (jitter: test_retry_budget.py)."""


def keys(retry: Mapping[str, Any] | None = None, **more: Any) -> dict[str, Any]:
    """One upstream's keys: ``more``, and ``retry`` over the ``FAST`` backoff."""
    return {**more, "retry": {**FAST, **(retry or {})}}


def pair(
    a: str,
    b: str,
    *,
    retry_a: Mapping[str, Any] | None = None,
    retry_b: Mapping[str, Any] | None = None,
    **keys_a: Any,
) -> str:
    """``primary`` (url ``a``, ``retry_a``, ``keys_a``) then ``backup`` (url ``b``,
    ``retry_b``); an empty ``[server]``."""
    return configs.fallback(a, b, server={}, primary=keys(retry_a, **keys_a), backup=keys(retry_b))


def single(
    url: str,
    *,
    retry: Mapping[str, Any] | None = None,
    server: Mapping[str, Any] | None = None,
    **more: Any,
) -> str:
    """``primary`` (``retry``, ``more``) alone on the route ``chat``."""
    return configs.single(url, server=server or {}, **keys(retry, **more))


def refused() -> str:
    return f"http://127.0.0.1:{closed_port()}"


@pytest.fixture
async def hanging_url() -> AsyncIterator[str]:
    """A URL whose connects hang (full accept queue): a real connect timeout."""
    host, port, cleanup = await saturated_listener()
    try:
        yield f"http://{host}:{port}"
    finally:
        cleanup()


async def post(
    http: aiohttp.ClientSession, url: str, *, stream: bool = False
) -> tuple[int, CIMultiDict[str], bytes]:
    async with http.post(url + CHAT, json={"model": "gpt-4o", "stream": stream}) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


Answer = tuple[int, CIMultiDict[str], bytes]
Run = Callable[..., Awaitable[Answer]]


@pytest.fixture
def run(start_sidecar: StartSidecar, http: aiohttp.ClientSession) -> Run:
    """``await run(config, stream=..., **options)``: start the sidecar on ``config``
    (``options`` to ``start_sidecar``), then :func:`post` one request to it."""

    async def go(config: str, *, stream: bool = False, **options: Any) -> Answer:
        sc = await start_sidecar(config, **options)
        return await post(http, sc.proxy_url, stream=stream)

    return go


def assert_via(headers: CIMultiDict[str], upstream: str, attempts: str) -> None:
    """The answer came from ``upstream`` after ``attempts`` attempts in all."""
    assert headers["x-sidecar-upstream"] == upstream
    assert headers["x-sidecar-attempts"] == attempts


def assert_error(
    code: int, headers: CIMultiDict[str], status: int, error: str, attempts: str
) -> None:
    """The sidecar's own ``status`` answer: ``x-sidecar-error: error`` after ``attempts``."""
    assert code == status
    assert headers["x-sidecar-error"] == error
    assert headers["x-sidecar-attempts"] == attempts


# -- retries, backoff, Retry-After ----------------------------------------------


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504, 529])
async def test_retryable_status_is_retried_then_falls_back(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
    status: int,
) -> None:
    fake.set_default(Fault(status=status))
    code, headers, body = await run(pair(fake.url, fake2.url, retry_a={"max_retries": 2}))
    assert code == 200
    assert_via(headers, "backup", "4")
    assert b"Hello from the fake upstream" in body
    assert fake.request_count == 3
    assert fake2.request_count == 1
    assert clock.sleeps == pytest.approx([0.01, 0.02])


async def test_retry_succeeds_on_the_same_candidate(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    fake.script([Fault(status=503), Fault(status=429), Fault(body=GOOD)])
    code, headers, body = await run(pair(fake.url, fake2.url, retry_a={"max_retries": 2}))
    assert (code, body) == (200, GOOD)
    assert_via(headers, "primary", "3")
    assert fake.request_count == 3
    assert fake2.request_count == 0
    assert clock.sleeps == pytest.approx([0.01, 0.02])


async def test_backoff_grows_exponentially_and_is_capped(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    fake.set_default(Fault(status=503))
    retry = {"max_retries": 5, "backoff_initial_ms": 100, "backoff_max_ms": 500}
    code, headers, _ = await run(pair(fake.url, fake2.url, retry_a=retry))
    assert code == 200
    assert headers["x-sidecar-attempts"] == "7"
    assert fake.request_count == 6
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


async def test_max_retries_zero_means_one_attempt(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    fake.set_default(Fault(status=503))
    code, headers, _ = await run(pair(fake.url, fake2.url, retry_a={"max_retries": 0}))
    assert code == 200
    assert headers["x-sidecar-attempts"] == "2"
    assert (fake.request_count, fake2.request_count) == (1, 1)
    assert clock.sleeps == []


async def test_status_outside_retry_statuses_is_not_retried(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
) -> None:
    """``statuses`` is the list: a 500 left out of it is the caller's, relayed at once."""
    fake.set_default(Fault(status=500, body=b'{"error": "primary 500"}'))
    retry = {"max_retries": 3, "statuses": [503]}
    code, headers, body = await run(pair(fake.url, fake2.url, retry_a=retry))
    assert (code, body) == (500, b'{"error": "primary 500"}')
    assert_via(headers, "primary", "1")
    assert (fake.request_count, fake2.request_count) == (1, 0)


async def test_retry_after_is_honoured_on_the_fake_clock(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    fake.script([Fault(status=429, retry_after="2"), Fault(body=GOOD)])
    code, headers, body = await run(pair(fake.url, fake2.url, retry_a={"max_retries": 2}))
    assert (code, body) == (200, GOOD)
    assert headers["x-sidecar-attempts"] == "2"
    assert clock.sleeps == [2.0]
    assert (fake.request_count, fake2.request_count) == (2, 0)


async def test_retry_after_as_http_date_is_honoured(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    # FakeClock: wall(now) = 2026-01-01T00:00:00Z + 1000 s = 00:16:40
    fake.script([Fault(status=503, retry_after="Thu, 01 Jan 2026 00:16:43 GMT"), Fault(body=GOOD)])
    code, _, body = await run(pair(fake.url, fake2.url, retry_a={"max_retries": 1}))
    assert (code, body) == (200, GOOD)
    assert clock.sleeps == pytest.approx([3.0])


async def test_retry_after_at_the_cap_is_honoured(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    fake.script([Fault(status=429, retry_after="3"), Fault(body=GOOD)])
    retry = {"max_retries": 1, "retry_after_max_ms": 3000}
    code, _, body = await run(pair(fake.url, fake2.url, retry_a=retry))
    assert (code, body) == (200, GOOD)
    assert clock.sleeps == [3.0]
    assert (fake.request_count, fake2.request_count) == (2, 0)


@pytest.mark.parametrize("value", ["soon", "", "-1", "Thu, 99 Foo 2026"])
async def test_unparseable_retry_after_falls_back_to_the_backoff(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
    value: str,
) -> None:
    fake.script([Fault(status=503, retry_after=value), Fault(body=GOOD)])
    code, _, body = await run(pair(fake.url, fake2.url, retry_a={"max_retries": 1}))
    assert (code, body) == (200, GOOD)
    assert clock.sleeps == pytest.approx([0.01])


async def test_retry_after_over_the_cap_falls_back_at_once(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    fake.set_default(Fault(status=429, retry_after="5"))
    retry = {"max_retries": 3, "retry_after_max_ms": 1000}
    code, headers, _ = await run(pair(fake.url, fake2.url, retry_a=retry))
    assert code == 200
    assert_via(headers, "backup", "2")
    assert (fake.request_count, fake2.request_count) == (1, 1)
    assert clock.sleeps == []


async def test_retry_after_over_the_cap_on_the_last_candidate_is_relayed(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    fake.set_default(Fault(status=503))
    limited = b'{"error": {"message": "slow down", "type": "rate_limit_exceeded"}}'
    fake2.set_default(Fault(status=429, retry_after="120", body=limited))
    retry = {"max_retries": 3, "retry_after_max_ms": 60000}
    code, headers, body = await run(
        pair(fake.url, fake2.url, retry_a={"max_retries": 0}, retry_b=retry)
    )
    assert code == 429
    assert body == limited
    assert headers["Retry-After"] == "120"
    assert_via(headers, "backup", "2")
    assert "x-sidecar-error" not in headers
    assert (fake.request_count, fake2.request_count) == (1, 1)
    assert clock.sleeps == []


# -- the last candidate's answer, the caller's errors ---------------------------


async def test_last_candidates_503_is_relayed_as_it_came(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
) -> None:
    fake.set_default(Fault(status=503, body=b'{"from": "primary"}'))
    backup_body = b'{"error": {"message": "backup overloaded", "type": "server_error"}}'
    fake2.set_default(
        Fault(status=503, retry_after="1", body=backup_body, headers={"X-Request-Id": "b-1"})
    )
    code, headers, body = await run(
        pair(fake.url, fake2.url, retry_a={"max_retries": 2}, retry_b={"max_retries": 1})
    )
    assert code == 503
    assert body == backup_body
    assert headers["Content-Type"] == "application/json"
    assert headers["Retry-After"] == "1"
    assert headers["X-Request-Id"] == "b-1"
    assert_via(headers, "backup", "5")
    assert "x-sidecar-error" not in headers
    assert (fake.request_count, fake2.request_count) == (3, 2)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 422])
async def test_callers_4xx_is_relayed_at_once(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
    status: int,
) -> None:
    err = b'{"error": {"message": "bad input", "type": "invalid_request_error"}}\n'
    fake.set_default(Fault(status=status, body=err, chunks=3))
    code, headers, body = await run(pair(fake.url, fake2.url, retry_a={"max_retries": 3}))
    assert (code, body) == (status, err)
    assert_via(headers, "primary", "1")
    assert (fake.request_count, fake2.request_count) == (1, 0)
    assert clock.sleeps == []


async def test_4xx_in_failure_statuses_falls_back(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
) -> None:
    """A status in ``circuit_breaker.failure_statuses`` moves on, even if not retried."""
    fake.set_default(Fault(status=409))
    cb = {"failure_statuses": [409], "failure_threshold": 5}
    code, headers, _ = await run(
        pair(fake.url, fake2.url, retry_a={"max_retries": 2}, circuit_breaker=cb)
    )
    assert code == 200
    assert_via(headers, "backup", "2")
    assert (fake.request_count, fake2.request_count) == (1, 1)


# -- first-byte timeout -----------------------------------------------------------


@pytest.mark.parametrize("hold", ["headers", "first_chunk"])
async def test_first_byte_timeout_goes_to_the_next_candidate_without_retry(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
    hold: str,
) -> None:
    never = asyncio.Event()
    held = Fault(hold_headers=never) if hold == "headers" else Fault(hold_first_chunk=never)
    fake.set_default(held)
    answer = run(
        pair(
            fake.url,
            fake2.url,
            retry_a={"max_retries": 3},
            first_byte_timeout_ms=150,
        ),
        stream=True,
    )
    code, headers, body = await on_fake_time(clock, fake, [(1, 0.15)], answer)
    assert code == 200
    assert_via(headers, "backup", "2")
    assert body.endswith(b"data: [DONE]\n\n")
    assert (fake.request_count, fake2.request_count) == (1, 1)
    assert clock.sleeps == []


async def test_first_byte_timeout_is_retried_with_retry_on_timeout(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    never = asyncio.Event()
    fake.script([Fault(hold_first_chunk=never), Fault(hold_first_chunk=never), Fault(body=GOOD)])
    answer = run(
        pair(
            fake.url,
            fake2.url,
            retry_a={"max_retries": 2, "retry_on_timeout": True},
            first_byte_timeout_ms=150,
        )
    )
    code, headers, body = await on_fake_time(clock, fake, [(1, 0.15), (2, 0.15)], answer)
    assert (code, body) == (200, GOOD)
    assert_via(headers, "primary", "3")
    assert (fake.request_count, fake2.request_count) == (3, 0)


async def test_last_candidate_first_byte_timeout_is_504(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    never = asyncio.Event()
    fake.set_default(Fault(status=503))
    fake2.set_default(Fault(hold_first_chunk=never))
    answer = run(
        configs.fallback(
            fake.url,
            fake2.url,
            server={},
            primary=keys({"max_retries": 1}),
            backup=keys({"max_retries": 2}, first_byte_timeout_ms=150),
        )
    )
    code, headers, body = await on_fake_time(clock, fake2, [(1, 0.15)], answer)
    assert_error(code, headers, 504, "upstream_timeout", "3")
    assert "x-sidecar-upstream" not in headers
    doc = json.loads(body)
    assert doc["error"]["code"] == "upstream_timeout"
    assert (fake.request_count, fake2.request_count) == (2, 1)


# -- resets before the commit point -----------------------------------------------


@pytest.mark.parametrize(
    "broken",
    [
        Fault(reset_after_headers=True),
        Fault(reset_before_headers=True),
        Fault(reset_after_chunks=0, keep_alive=False),
    ],
    ids=["after_headers", "before_headers", "zero_chunks_connection_close"],
)
async def test_reset_before_the_first_chunk_is_retried_invisibly(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
    broken: Fault,
) -> None:
    fake.script([broken, Fault(body=GOOD)])
    code, headers, body = await run(pair(fake.url, fake2.url, retry_a={"max_retries": 2}))
    assert (code, body) == (200, GOOD)
    assert_via(headers, "primary", "2")
    assert (fake.request_count, fake2.request_count) == (2, 0)


async def test_reset_after_headers_on_a_stream_is_retried_invisibly(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    run: Run,
) -> None:
    fake.script([Fault(reset_after_headers=True)])
    code, headers, body = await run(
        pair(fake.url, fake2.url, retry_a={"max_retries": 2}), stream=True
    )
    assert code == 200
    assert headers["x-sidecar-attempts"] == "2"
    assert body.count(b"\n\n") == 8 and body.endswith(b"data: [DONE]\n\n")
    assert b"fake000002" in body
    assert (fake.request_count, fake2.request_count) == (2, 0)


async def test_last_candidate_reset_before_first_chunk_is_502(
    fake: FakeUpstream,
    run: Run,
) -> None:
    fake.set_default(Fault(reset_after_headers=True))
    code, headers, body = await run(single(fake.url, retry={"max_retries": 1}))
    assert_error(code, headers, 502, "upstream_unavailable", "2")
    assert b'"upstream_unavailable"' in body
    assert fake.request_count == 2


# -- after the commit point --------------------------------------------------------


# A stream's commit point is its first output event: the role-only first chunk is
# held, so a cut after it is a cut before the commit point (retried, falls back).
@pytest.mark.parametrize("after", [2, 3])
async def test_midstream_cut_aborts_the_client_and_never_falls_back(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    after: int,
) -> None:
    fake.set_default(Fault(reset_after_chunks=after))
    sc = await start_sidecar(pair(fake.url, fake2.url, retry_a={"max_retries": 2}))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m", "stream": True}) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "primary"
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in r.content.iter_any():
                received += chunk
    assert received.count(b"\n\n") == after
    assert b"[DONE]" not in received
    assert (fake.request_count, fake2.request_count) == (1, 0)


async def test_a_json_body_cut_before_its_end_is_a_failure_before_the_commit_point(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """A JSON answer is read whole before its commit point (contract, "An empty turn
    is a failure"), so a Content-Length JSON body cut short is a failure before the
    commit point: retried, then the next candidate; the client gets a whole answer."""
    fake.set_default(Fault(body=GOOD * 10, chunks=4, reset_after_chunks=2))
    sc = await start_sidecar(pair(fake.url, fake2.url, retry_a={"max_retries": 2}))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "backup"
        assert (await r.json())["object"] == "chat.completion"
    assert (fake.request_count, fake2.request_count) == (3, 1)


async def test_midstream_cut_of_a_body_not_judged_aborts_the_client(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """A Content-Length body that is not read whole (not JSON) commits at its first
    chunk; cut short after it, it is never completed nor replayed."""
    fake.set_default(
        Fault(body=GOOD * 10, chunks=4, reset_after_chunks=2, content_type="text/plain")
    )
    sc = await start_sidecar(pair(fake.url, fake2.url, retry_a={"max_retries": 2}))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    assert (fake.request_count, fake2.request_count) == (1, 0)


async def test_idle_timeout_after_commit_aborts_the_client(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    fake.set_default(Fault(stall_after_chunks=2))
    sc = await start_sidecar(  # real time: the stall is timed against the relay's own pace
        pair(fake.url, fake2.url, retry_a={"max_retries": 2}, idle_timeout_ms=150),
        clock_=LoopClock(),
    )
    async with http.post(sc.proxy_url + CHAT, json={"model": "m", "stream": True}) as r:
        assert r.status == 200
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in r.content.iter_any():
                received += chunk
    assert received.count(b"\n\n") == 2
    assert (fake.request_count, fake2.request_count) == (1, 0)


async def test_slow_but_steady_stream_is_not_cut_by_the_idle_timeout(
    fake: FakeUpstream,
    run: Run,
) -> None:
    """``idle_timeout_ms`` bounds each gap, not the whole stream (7 gaps of 80 ms > 400 ms)."""
    fake.set_default(Fault(chunk_delay_ms=80))
    # Real time: the upstream's real 80 ms gaps are what the idle timeout must tolerate.
    code, _, body = await run(
        single(fake.url, idle_timeout_ms=400), stream=True, clock_=LoopClock()
    )
    assert code == 200
    assert body.endswith(b"data: [DONE]\n\n")


# -- connect failures -------------------------------------------------------------


async def test_connect_refused_is_retried_then_falls_back(
    fake2: FakeUpstream,
    run: Run,
    clock: FakeClock,
) -> None:
    code, headers, _ = await run(pair(refused(), fake2.url, retry_a={"max_retries": 2}))
    assert code == 200
    assert_via(headers, "backup", "4")
    assert fake2.request_count == 1
    assert clock.sleeps == pytest.approx([0.01, 0.02])


async def test_connect_timeout_falls_back(
    hanging_url: str,
    fake2: FakeUpstream,
    run: Run,
) -> None:
    code, headers, _ = await run(
        pair(hanging_url, fake2.url, retry_a={"max_retries": 1}, connect_timeout_ms=100)
    )
    assert code == 200
    assert_via(headers, "backup", "3")
    assert fake2.request_count == 1


async def test_last_candidate_connect_timeout_is_502_not_504(
    hanging_url: str,
    run: Run,
) -> None:
    code, headers, body = await run(
        single(hanging_url, retry={"max_retries": 1}, connect_timeout_ms=100)
    )
    assert_error(code, headers, 502, "upstream_unavailable", "2")
    assert b'"upstream_unavailable"' in body


async def test_all_candidates_refused_is_502(run: Run) -> None:
    code, headers, body = await run(
        pair(refused(), refused(), retry_a={"max_retries": 1}, retry_b={"max_retries": 0})
    )
    assert_error(code, headers, 502, "upstream_unavailable", "3")
    assert "x-sidecar-upstream" not in headers
    assert b"127.0.0.1" not in body


async def test_connect_error_last_after_an_http_error_is_502(
    fake: FakeUpstream,
    run: Run,
) -> None:
    """The answer follows the *last* candidate tried: its connect error, not the 503 before."""
    fake.set_default(Fault(status=503))
    code, headers, _ = await run(
        pair(fake.url, refused(), retry_a={"max_retries": 0}, retry_b={"max_retries": 0})
    )
    assert_error(code, headers, 502, "upstream_unavailable", "2")


async def test_http_error_last_after_a_connect_error_is_relayed(
    fake2: FakeUpstream,
    run: Run,
) -> None:
    fake2.set_default(Fault(status=503, body=b"backup says no"))
    code, headers, body = await run(
        pair(refused(), fake2.url, retry_a={"max_retries": 0}, retry_b={"max_retries": 0})
    )
    assert (code, body) == (503, b"backup says no")
    assert_via(headers, "backup", "2")


# -- the request deadline ---------------------------------------------------------


async def test_deadline_during_connect_retry_backoff_is_502(run: Run) -> None:
    """The deadline hits while the refused connect waits its (real, long) backoff."""
    code, headers, body = await run(
        single(
            refused(),
            retry={"max_retries": 3, "backoff_initial_ms": 20000, "backoff_max_ms": 20000},
            server={"request_timeout_ms": 300},
        ),
        clock_=LoopClock(),
    )
    assert_error(code, headers, 502, "upstream_unavailable", "1")
    assert b'"upstream_unavailable"' in body


async def test_deadline_while_waiting_for_the_first_byte_is_504(
    fake: FakeUpstream, run: Run, clock: FakeClock
) -> None:
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
    answer = run(single(fake.url, server={"request_timeout_ms": 200}))
    code, headers, _ = await on_fake_time(clock, fake, [(1, 0.2)], answer)
    assert code == 504
    assert headers["x-sidecar-error"] == "upstream_timeout"
    assert headers["x-sidecar-attempts"] == "1"  # the attempt was sent, then cut
    assert fake.request_count == 1

"""Slow and vanishing clients: cut off in time, never blocking others, leaving nothing behind.

``server.client_read_timeout_ms`` bounds both the request head (sidecar.wire.downstream)
and the body (sidecar.proxy). A client that goes away releases its upstream
connection, its breaker permit and its tasks at once.

Slow clients are paced with short sleeps on purpose: slowness is what is under
test. Every wait for the sidecar's or the fake's state is on an event (the
socket closing, ``fake.wait_until``) under a bound.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from sidecar.clock import LoopClock
from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.configs import single
from tests.conftest import StartSidecar, status
from tests.rawhttp import WAIT_S, RawConn

READ_TIMEOUT_MS = 500
CHAT = "/v1/chat/completions"
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"


# One upstream ``primary`` (no retries; a breaker only where a test adds it), one route.
SERVER = {"client_read_timeout_ms": READ_TIMEOUT_MS}
NO_RETRY = {"max_retries": 0}


@pytest.fixture
async def sc(fake: FakeUpstream, start_sidecar: StartSidecar) -> Sidecar:
    # Real time: the clients' own pace (bytes every 50 ms) is what is under test, and
    # the deadlines are checked against the real elapsed time.
    return await start_sidecar(single(fake.url, server=SERVER, retry=NO_RETRY), clock_=LoopClock())


async def served_normally(http: aiohttp.ClientSession, sc: Sidecar) -> None:
    async with http.post(sc.proxy_url + CHAT, json={"model": "gpt-4o"}) as r:
        assert r.status == 200
        assert (await r.json())["choices"][0]["message"]["content"]


async def until(predicate: object, turns: int = 2000) -> bool:
    """Let the loop run (``turns`` iterations, IO polled each time) until ``predicate()``."""
    assert callable(predicate)
    for _ in range(turns):
        if predicate():
            return True
        await asyncio.sleep(0)
    return bool(predicate())


# -- slow clients --------------------------------------------------------------------


async def test_slow_headers_get_408_and_close_while_another_client_is_served(
    sc: Sidecar, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    loop = asyncio.get_running_loop()
    async with await RawConn.open(sc.proxy_port) as slow:
        started = loop.time()
        await slow.send(HEAD + b"Content-Le")  # an incomplete head, then nothing
        await served_normally(http, sc)
        assert not slow.reader.at_eof(), "the slow client was cut off before its deadline"
        answer = await slow.closed_by_peer()
        elapsed = loop.time() - started
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"Connection: close" in answer
    assert elapsed >= READ_TIMEOUT_MS / 1000 * 0.9
    assert fake.request_count == 1


async def test_dribbled_headers_are_cut_off_at_the_deadline_despite_progress(
    sc: Sidecar, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Slowloris: a byte every 50 ms keeps any per-read timeout happy, not the head deadline."""
    head = HEAD + b"X-Pad: " + b"p" * 200 + b"\r\n\r\n"
    loop = asyncio.get_running_loop()
    async with await RawConn.open(sc.proxy_port) as slow:
        started = loop.time()
        reading = asyncio.create_task(slow.closed_by_peer())
        sent = 0
        while sent < len(head) and not reading.done():
            await slow.send(head[sent : sent + 1])
            sent += 1
            # The client's pace: one byte per 50 ms, or stop at once when the
            # sidecar closes the connection.
            await asyncio.wait({reading}, timeout=0.05)
        elapsed = loop.time() - started
        answer = await reading
    assert sent < len(head), "the whole head got through"
    assert elapsed < READ_TIMEOUT_MS / 1000 + 2.0
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert fake.request_count == 0
    await served_normally(http, sc)


async def test_silent_connection_is_closed_without_an_answer(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    async with await RawConn.open(sc.proxy_port) as silent:
        assert await silent.closed_by_peer() == b""
    assert fake.connections_accepted == 0


async def test_idle_keep_alive_connection_is_closed_quietly_after_the_deadline(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    """After a response, the next head has the same deadline; an idle connection just closes."""
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(HEAD + b"Content-Length: 2\r\n\r\n{}")
        assert (await conn.response()).status == 200
        assert await conn.closed_by_peer() == b""
    assert fake.request_count == 1


async def test_connection_idle_after_a_router_404_is_closed_quietly_too(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    """A request the router answers itself (``OPTIONS *``) counts as served: no stray 408."""
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(b"OPTIONS * HTTP/1.1\r\nHost: sidecar\r\n\r\n")
        assert (await conn.response()).status == 404
        assert await conn.closed_by_peer() == b""
    assert fake.connections_accepted == 0


async def test_keep_alive_connection_serves_requests_back_to_back(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    """The deadline restarts after each request: a busy connection is never cut."""
    async with await RawConn.open(sc.proxy_port) as conn:
        for _ in range(5):
            await conn.send(HEAD + b"Content-Length: 2\r\n\r\n{}")
            assert (await conn.response()).status == 200
    assert fake.request_count == 5


async def test_slow_body_gets_400_and_close_while_another_client_is_served(
    sc: Sidecar, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with await RawConn.open(sc.proxy_port) as slow:
        await slow.send(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"model": "gp')
        await served_normally(http, sc)
        resp = await slow.response()
        assert await slow.closed_by_peer() == b""
    assert resp.status == 400
    assert resp.headers["x-sidecar-error"] == "bad_request"
    assert "in time" in resp.json()["error"]["message"]
    assert fake.request_count == 1


# -- vanishing clients ----------------------------------------------------------------


async def test_client_gone_before_the_answer_frees_upstream_connection_probe_and_tasks(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(
        single(
            fake.url,
            server=SERVER,
            retry=NO_RETRY,
            circuit_breaker={"failure_threshold": 1, "cooldown_ms": 1000},
        )
    )
    fake.script([Fault(status=503, keep_alive=False)])
    async with http.post(sc.proxy_url + CHAT, json={"model": "gpt-4o"}) as r:
        assert r.status == 503
    clock.advance(1.0)
    assert (await status(http, sc))["primary/*"]["state"] == "half_open"
    async with asyncio.timeout(WAIT_S):
        await fake.wait_until(lambda: fake.open_connections == 0)

    gate = asyncio.Event()  # never set: the upstream holds its answer
    fake.script([Fault(hold_headers=gate)])
    tasks_before = len(asyncio.all_tasks())
    async with await RawConn.open(sc.proxy_port) as client:
        await client.send(HEAD + b"Content-Length: 2\r\n\r\n{}")
        async with asyncio.timeout(WAIT_S):
            await fake.wait_until(lambda: fake.active_requests == 1)
        assert fake.open_connections == 1
        client.abort()
        async with asyncio.timeout(WAIT_S):
            await fake.wait_until(lambda: fake.open_connections == 0 and fake.active_requests == 0)
    assert await until(lambda: len(asyncio.all_tasks()) <= tasks_before), (
        f"{len(asyncio.all_tasks())} tasks, {tasks_before} before"
    )

    entry = (await status(http, sc))["primary/*"]
    assert entry["state"] == "half_open"  # a client leaving is neutral
    assert entry["probes_in_flight"] == 0
    async with http.post(sc.proxy_url + CHAT, json={"model": "gpt-4o"}) as r:
        assert r.status == 200  # the probe slot was free for the next caller
    assert (await status(http, sc))["primary/*"]["state"] == "closed"


async def test_client_gone_mid_stream_frees_upstream_connection_and_tasks(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    gate = asyncio.Event()  # never set: the stream stalls after two events
    fake.script([Fault(hold_after_chunks=(2, gate))])
    body = b'{"model": "gpt-4o", "stream": true}'
    tasks_before = len(asyncio.all_tasks())
    async with await RawConn.open(sc.proxy_port) as client:
        await client.send(HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        async with asyncio.timeout(WAIT_S):
            await client.reader.readuntil(b"data: ")  # the stream has started
        assert fake.active_requests == 1
        client.abort()
        async with asyncio.timeout(WAIT_S):
            await fake.wait_until(lambda: fake.open_connections == 0 and fake.active_requests == 0)
    assert await until(lambda: len(asyncio.all_tasks()) <= tasks_before), (
        f"{len(asyncio.all_tasks())} tasks, {tasks_before} before"
    )

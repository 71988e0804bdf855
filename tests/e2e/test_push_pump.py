"""A stream after its commit point, while its chunks are pushed from the upstream connection.

After the commit point, a chunked stream's bytes go to the client from the upstream
connection's own data callback (``sidecar.wire.push_pump``). Each test here holds the
upstream between events with :class:`asyncio.Event` gates, so the event it is about
arrives while the pump is attached, not with the bytes read before the commit. What
a client must see: each event as it comes; the idle deadline counted from the last
event, not from the commit; a cut or an idle gap aborting it (logged ``aborted``);
and the upstream connection back in the pool for the next request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from sidecar.testing import FakeClock, shapes
from tests.access_log_helpers import Lines, capture, without_ts
from tests.app_upstream import serve_post
from tests.configs import single
from tests.conftest import StartSidecar

CHAT = "/v1/chat/completions"
GUARD_S = 5.0
IDLE_MS = 1000
EVENTS = shapes.chat_completion_stream("gpt-4o", ["a", "b", "c"], rid="chatcmpl-push")
"""role-only, "a" (the commit point), "b", "c", finish, [DONE]."""


class GatedStream:
    """A real aiohttp upstream: sends ``EVENTS``, waiting on ``gates[i]`` before event ``i``.

    ``cut_at``: instead of event ``cut_at`` (after its gate), abort the connection.
    ``peers``: the client addresses of its connections (keep-alive reuse keeps one).
    """

    def __init__(self) -> None:
        self.gates = {i: asyncio.Event() for i in range(len(EVENTS))}
        self.cut_at: int | None = None
        self.peers: set[object] = set()
        self.requests = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.requests += 1
        assert request.transport is not None
        self.peers.add(request.transport.get_extra_info("peername"))
        if request.headers.get("x-test-json"):
            return web.json_response({"id": "json", "choices": []})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, event in enumerate(EVENTS):
            if i > 1:  # the role-only event and the first output go out together
                await self.gates[i].wait()
            if i == self.cut_at:
                assert request.transport is not None
                request.transport.abort()
                return resp
            await resp.write(event)
        await resp.write_eof()
        return resp

    async def start(self) -> None:
        self._runner, self.url = await serve_post(CHAT, self.handle)

    async def stop(self) -> None:
        self.open_all()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest_asyncio.fixture
async def gated() -> AsyncIterator[GatedStream]:
    upstream = GatedStream()
    await upstream.start()
    yield upstream
    await upstream.stop()


@pytest.fixture
def access() -> Iterator[Lines]:
    yield from capture()


async def read_events(r: aiohttp.ClientResponse, n: int) -> bytes:
    out = b""
    async with asyncio.timeout(GUARD_S):
        for _ in range(n):
            out += await r.content.readuntil(b"\n\n")
    return out


async def commit_and_push_one(r: aiohttp.ClientResponse, gated: GatedStream) -> bytes:
    """Read the committed events (role-only and "a"), then let "b" go and read it (pushed)."""
    got = await read_events(r, 2)
    gated.gates[2].set()
    return got + await read_events(r, 1)


async def start(start_sidecar: StartSidecar, url: str, **keys: Any) -> str:
    sc = await start_sidecar(single(url, idle_timeout_ms=IDLE_MS, **keys))
    return sc.proxy_url + CHAT


STREAM = {"model": "gpt-4o", "stream": True}


async def test_each_pushed_event_resets_the_idle_deadline(
    gated: GatedStream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    access: Lines,
) -> None:
    """1.2 idle timeouts pass after the commit, but never 1.0 without an event."""
    url = await start(start_sidecar, gated.url)
    async with http.post(url, json=STREAM) as r:
        assert r.status == 200
        got = await read_events(r, 2)  # committed: headers, role-only and "a"
        clock.advance(0.6 * IDLE_MS / 1000)
        gated.gates[2].set()
        got += await read_events(r, 1)  # "b", pushed
        clock.advance(0.6 * IDLE_MS / 1000)
        gated.open_all()
        async with asyncio.timeout(GUARD_S):
            got += await r.read()
    assert got == b"".join(EVENTS)
    (entry,) = without_ts(await access.wait(1))
    assert (entry["status"], entry["outcome"]) == (200, "ok")


async def test_an_idle_gap_while_pushing_aborts_the_client(
    gated: GatedStream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    access: Lines,
) -> None:
    url = await start(start_sidecar, gated.url)
    async with http.post(url, json=STREAM) as r:
        assert r.status == 200
        got = await commit_and_push_one(r, gated)
        clock.advance(IDLE_MS / 1000 + 0.001)
        async with asyncio.timeout(GUARD_S):
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
    assert got == b"".join(EVENTS[:3])
    (entry,) = without_ts(await access.wait(1))
    assert (entry["status"], entry["outcome"]) == (200, "aborted")
    assert gated.requests == 1


async def test_an_upstream_cut_while_pushing_aborts_the_client(
    gated: GatedStream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
) -> None:
    gated.cut_at = 3  # after "b"
    url = await start(start_sidecar, gated.url, retry={"max_retries": 2})
    async with http.post(url, json=STREAM) as r:
        assert r.status == 200
        got = await commit_and_push_one(r, gated)
        gated.gates[3].set()
        async with asyncio.timeout(GUARD_S):
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
    assert got == b"".join(EVENTS[:3])
    (entry,) = without_ts(await access.wait(1))
    assert (entry["status"], entry["outcome"], entry["attempts"]) == (200, "aborted", 1)
    assert gated.requests == 1  # never retried after the commit point


async def test_the_connection_of_a_pushed_stream_serves_the_next_request(
    gated: GatedStream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """With one pooled connection, a pushed stream gives it back at its end, and the next
    answer on it goes to its own client only."""
    url = await start(start_sidecar, gated.url, max_connections=1)
    for _ in range(2):
        async with http.post(url, json=STREAM) as r:
            got = await commit_and_push_one(r, gated)
            gated.open_all()
            async with asyncio.timeout(GUARD_S):
                got += await r.read()
        assert got == b"".join(EVENTS)
        async with asyncio.timeout(GUARD_S):
            async with http.post(url, json={"model": "gpt-4o"}, headers={"x-test-json": "1"}) as j:
                assert (j.status, await j.json()) == (200, {"id": "json", "choices": []})
        for gate in gated.gates.values():
            gate.clear()
    assert (gated.requests, len(gated.peers)) == (4, 1)

"""The access log of requests cut short: mid-stream (``aborted``), a client leaving
(``client_closed``, 499), and ``overloaded`` refusals (``rejected``, route null).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from sidecar.testing import FakeUpstream, Fault
from tests.access_log_helpers import (
    CHAT,
    WAIT_S,
    Lines,
    access_config,
    capture,
    line,
    post,
    without_ts,
)
from tests.conftest import StartSidecar


@pytest.fixture
def access() -> Iterator[Lines]:
    yield from capture()


async def test_overloaded_is_rejected(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    access: Lines,
) -> None:
    sc = await start_sidecar(access_config(fake.url, server={"max_concurrent_requests": 1}))
    gate = asyncio.Event()
    fake.set_default(Fault(hold_headers=gate))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        held = asyncio.create_task(post(http, sc.proxy_url + CHAT))
        async with asyncio.timeout(WAIT_S):
            await fake.wait_for_requests(1)
        assert await post(http, sc.proxy_url + CHAT) == 503
        gate.set()
        assert await held == 200
    refused = without_ts(await access.wait(2))[0]
    assert refused == line(
        route=None,
        status=503,
        upstream=None,
        attempts=0,
        first_byte_ms=None,
        outcome="rejected",
        error="overloaded",
    )


async def test_midstream_cut_is_aborted(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
) -> None:
    fake.set_default(Fault(reset_after_chunks=3))
    sc = await start_sidecar(access_config(fake.url))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m", "stream": True}) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    assert without_ts(await access.wait(1)) == [line(outcome="aborted")]


@pytest.mark.parametrize("when", ["before_the_answer", "mid_stream"])
async def test_a_client_leaving_is_client_closed_499(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    when: str,
) -> None:
    gate = asyncio.Event()
    committed = when == "mid_stream"
    fake.set_default(Fault(hold_after_chunks=(2, gate)) if committed else Fault(hold_headers=gate))
    sc = await start_sidecar(access_config(fake.url))
    request = asyncio.ensure_future(
        http.post(sc.proxy_url + CHAT, json={"model": "m", "stream": True})
    )
    async with asyncio.timeout(WAIT_S):
        if committed:
            r = await request
            assert await r.content.readany()
            r.close()  # the client goes away mid-stream
        else:
            await fake.wait_for_requests(1)
            request.cancel()  # the client goes away before any answer
    lines = without_ts(await access.wait(1))
    gate.set()
    first_byte = 0.0 if committed else None
    upstream = "primary" if committed else None
    expected = line(status=499, upstream=upstream, first_byte_ms=first_byte)
    assert lines == [expected | {"outcome": "client_closed"}]

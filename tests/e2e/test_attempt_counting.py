"""x-sidecar-attempts counts attempts that were sent, not requests queued for a connection."""

from __future__ import annotations

import asyncio

import aiohttp

from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar


def one_connection(url: str) -> str:
    """Upstream ``ac_one`` with one connection, a 300 ms request deadline."""
    return config(
        server={"request_timeout_ms": 300, "drain_timeout_ms": 200},
        upstreams={"ac_one": upstream(url, max_connections=1)},
        routes=[route("chat", "ac_one", path_prefix="/v1/")],
    )


async def test_deadline_while_queued_for_a_connection_counts_no_attempt(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(one_connection(fake.url))
    gate = asyncio.Event()
    # A committed stream holds the only pooled connection (after the commit point
    # the request deadline no longer applies to it).
    fake.script([Fault(hold_after_chunks=(2, gate))])
    holder = await http.post(
        sc.proxy_url + "/v1/chat/completions", json={"model": "m", "stream": True}
    )
    try:
        assert holder.status == 200
        assert (await holder.content.readany()).startswith(b"data: ")
        # The only pooled connection is busy: this request waits for it until the
        # request deadline (300 ms, on the fake clock) answers 504; nothing was sent.
        queued = asyncio.ensure_future(http.post(sc.proxy_url + "/v1/x", json={"model": "m"}))
        assert sc.runtime is not None
        pool = sc.runtime.current.upstreams["ac_one"].pool
        assert pool is not None
        for _ in range(10_000):
            if pool.waiting:
                break
            await asyncio.sleep(0)
        else:
            raise AssertionError("never queued")
        clock.advance(0.3)
        async with await queued as r:
            assert r.status == 504
            assert r.headers["x-sidecar-error"] == "upstream_timeout"
            assert r.headers["x-sidecar-attempts"] == "0"
        assert fake.request_count == 1
    finally:
        gate.set()
        await holder.read()
        holder.release()

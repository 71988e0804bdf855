"""``sidecar serve``'s loop (``server.serve_until_signal``) tunes the collector once its
servers listen, and still drains and stops when told to."""

from __future__ import annotations

import asyncio
import gc

import aiohttp
import pytest

from sidecar import collector, server
from sidecar.config import parse_config
from sidecar.server import Sidecar, serve_until_signal
from sidecar.testing import FakeClock, FakeUpstream
from tests.configs import single


async def test_serve_tunes_the_collector_after_its_servers_listen(
    gc_restored: None,
    fake: FakeUpstream,
    clock: FakeClock,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tuned = asyncio.Event()

    def tune_and_tell() -> None:
        collector.tune_for_serving()
        tuned.set()

    monkeypatch.setattr(server, "tune_for_serving", tune_and_tell)
    sc = Sidecar(
        parse_config(single(fake.url), {}),
        environ={},
        clock=clock,
        proxy_listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
    )
    stop = asyncio.Event()
    serving = asyncio.create_task(serve_until_signal(sc, stop))
    try:
        async with asyncio.timeout(5):
            await tuned.wait()
        assert gc.get_threshold()[0] == collector.YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 0
        async with http.get(sc.admin_url + "/healthz") as r:  # it listens, then tunes
            assert r.status == 200
    finally:
        stop.set()
        async with asyncio.timeout(5):
            await serving

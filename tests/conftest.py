"""Shared fixtures: fake upstreams on loopback, the real sidecar in front, a client.

Everything is a real server on 127.0.0.1 port 0. Time that decides state
(cooldowns, backoff, Retry-After) runs on a :class:`FakeClock` unless a test
asks for the loop clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Mapping
from random import Random
from typing import Any, TypeVar

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import settings

from sidecar.clock import Clock
from sidecar.config import parse_config
from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream
from tests.rawhttp import RawHandler, RawUpstream

StartSidecar = Callable[..., Coroutine[Any, Any, Sidecar]]
T = TypeVar("T")

# No per-example wall-clock deadline (Hypothesis' default is 200 ms): on a loaded
# machine a slow example is not a failure; pytest-timeout still fails a hang by name.
settings.register_profile("sidecar", deadline=None)
settings.load_profile("sidecar")


@pytest.fixture
def gc_restored() -> Iterator[None]:
    """For tests that tune the garbage collector: its thresholds and frozen objects are
    as before once the test ends."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock at t=1000 s; ``clock.advance(s)`` fires due breaker timers."""
    return FakeClock()


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    """One fake upstream, named "primary" (``x-fake-fault-for: primary`` aims a fault at it)."""
    async with FakeUpstream(name="primary") as f:
        yield f


@pytest_asyncio.fixture
async def fake2() -> AsyncIterator[FakeUpstream]:
    """A second fake upstream, named "backup"."""
    async with FakeUpstream(name="backup") as f:
        yield f


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain client: no decompression, no redirects followed by default in tests."""
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        yield s


@pytest_asyncio.fixture
async def raw_upstream() -> AsyncIterator[RawUpstream]:
    """``url = await raw_upstream(handler)``: a raw TCP upstream on 127.0.0.1 port 0, for
    answers no aiohttp server would send (closed when the test ends, with every
    connection it accepted: Python 3.11's ``Server.close`` leaves those open, and a
    handler that returns without closing its writer left the socket to the garbage
    collector, a ``ResourceWarning`` after the loop had closed)."""
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []

    async def start(handler: RawHandler) -> str:
        async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            await handler(reader, writer)

        server = await asyncio.start_server(tracked, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()
    for writer in writers:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest_asyncio.fixture
async def start_sidecar(clock: FakeClock) -> AsyncIterator[StartSidecar]:
    """``await start_sidecar(toml, environ=..., clock=..., rand=...)`` -> a started
    :class:`Sidecar` (the tier chooser's random source seeded: ``Random(0)`` unless given).

    The TOML text is validated like a file; proxy and admin listen on
    127.0.0.1 port 0. Every sidecar started is stopped after the test.
    """
    started: list[Sidecar] = []

    async def start(
        toml: str,
        *,
        environ: Mapping[str, str] | None = None,
        clock_: Clock | None = None,
        rand: Random | None = None,
    ) -> Sidecar:
        env = dict(environ or {})
        config = parse_config(toml, env)
        sc = Sidecar(
            config,
            environ=env,
            clock=clock_ or clock,
            proxy_listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            rand=rand if rand is not None else Random(0),
        )
        await sc.start()
        started.append(sc)
        return sc

    yield start
    for sc in started:
        await sc.stop()


async def status(http: aiohttp.ClientSession, sc: Sidecar, all_: bool = True) -> dict[str, Any]:
    """``/status`` (``?all=1`` by default) as JSON, keyed by "upstream/model" (a breaker
    of (target, credential): "upstream/model@credential")."""
    async with http.get(sc.admin_url + "/status" + ("?all=1" if all_ else "")) as r:
        assert r.status == 200
        body = await r.json()
    return {
        f"{b['upstream']}/{b['model']}" + (f"@{b['credential']}" if "credential" in b else ""): b
        for b in body["breakers"]
    }


async def metric(http: aiohttp.ClientSession, sc: Sidecar, name: str, **labels: str) -> float:
    """The value of one sample scraped from ``/metrics`` (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(sc.admin_url + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


async def on_fake_time(
    clock: FakeClock,
    fake: FakeUpstream,
    steps: list[tuple[int, float]],
    aw: Awaitable[T],
) -> T:
    """Await ``aw`` while moving the fake clock: for each ``(n, seconds)``, once ``fake``
    has received its ``n``-th request, advance ``clock`` by ``seconds``.

    The sidecar arms an attempt's deadlines before it sends the attempt, so once the
    fake upstream holds the request, the advance fires the deadline it is waiting on
    (first byte, request) without any wait in real time.
    """
    task = asyncio.ensure_future(aw)
    try:
        for n, seconds in steps:
            async with asyncio.timeout(10):
                await fake.wait_for_requests(n)
            clock.advance(seconds)
        return await task
    finally:
        if not task.done():
            task.cancel()

"""Shared set-up of the fleet's tests: a private Redis, fleet configs, bounded waits.

``redis_server`` starts a private ``redis-server`` (tests/redis_proc.py) for one test
and stops it after; the tests are skipped where the binary is missing (CI installs
Debian's ``redis-server`` package in ``.ci/run``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import pytest
import pytest_asyncio

from sidecar.server import Sidecar
from sidecar.testing import FakeClock
from tests.configs import config, route, upstream
from tests.redis_proc import RedisProc, redis_server_path

WAIT_S = 10.0
"""Upper bound on a wait for a condition across processes (a failure, not a pace)."""

T = TypeVar("T")

needs_redis = pytest.mark.skipif(
    redis_server_path() is None, reason="redis-server not installed (apt-get install redis-server)"
)


async def synced(sc: Sidecar, n: int) -> None:
    """Wait (bounded by :data:`WAIT_S`) until ``sc``'s fleet has completed ``n`` sync rounds."""
    assert sc.fleet is not None
    async with asyncio.timeout(WAIT_S):
        await sc.fleet.sync_loop.wait_syncs(n)


async def next_sync(sc: Sidecar, clock: FakeClock, seconds: float) -> None:
    """Advance the shared fake clock by ``seconds`` (at least one sync interval) and wait
    for a sync round of ``sc`` that began after this call, so it read the store after
    every write made before the call.

    A round already in flight (woken by another member's advance of the shared clock or
    by an announcement) may have read the store before the write the caller waits to
    see: it is let to end first. Only then is the count taken and the clock moved.
    """
    assert sc.fleet is not None
    loop = sc.fleet.sync_loop
    await synced(sc, loop.syncs_started)
    n = loop.syncs
    clock.advance(seconds)
    await synced(sc, n + 1)


async def start_members(
    start_sidecar: Callable[..., Awaitable[Sidecar]],
    text: str,
    redis: RedisProc,
    n: int,
    env: Callable[[int], Mapping[str, str]] = lambda i: {},
) -> list[Sidecar]:
    """``n`` members of one fleet: sidecars of config ``text`` on ``redis``, named
    ``pod-0``, ``pod-1``, ... (``HOSTNAME``) with ``env(i)`` in their environment, each
    back once its first sync round has ended."""
    out = []
    for i in range(n):
        environ = {"HOSTNAME": f"pod-{i}", "SIDECAR_REDIS_URL": redis.url(), **env(i)}
        out.append(await start_sidecar(text, environ=environ))
    for sc in out:
        await synced(sc, 1)
    return out


@pytest.fixture
def roomy_lease_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Widen the probe lease's 250 ms bound (loop time, not the fake clock) to
    :data:`WAIT_S`, for tests that count which member probed: on a loaded machine a
    lease answer later than 250 ms would leave a member to decide alone and probe
    too. Tests of that bound itself do not use this."""
    from sidecar.fleet import member

    monkeypatch.setattr(member, "LEASE_WAIT_S", WAIT_S)


@pytest_asyncio.fixture
async def redis_server() -> AsyncIterator[RedisProc]:
    """A private redis-server on a free loopback port, killed after the test."""
    proc = await RedisProc().start()
    try:
        yield proc
    finally:
        await proc.kill()


def chain_config(
    primary_url: str,
    backup_url: str,
    *,
    threshold: int = 1,
    cooldown_ms: int = 10_000,
    sync_ms: int = 100,
    quorum: int = 1,
    server: Mapping[str, Any] | None = None,
    primary_keys: Mapping[str, Any] | None = None,
    fleet: bool = True,
) -> str:
    """Route "chat": primary (breaker, no retries, ``primary_keys``), then backup (no
    breaker); with a ``[fleet]`` table (Redis URL from ``SIDECAR_REDIS_URL``, key
    prefix ``sidecar:``) unless ``fleet`` is False. Built by :mod:`tests.configs`."""
    retry = {"max_retries": 0, "backoff_initial_ms": 1, "backoff_max_ms": 1}
    cb = {
        "failure_threshold": threshold,
        "cooldown_ms": cooldown_ms,
        "half_open_max_probes": 1,
        "success_threshold": 1,
    }
    tables: dict[str, Any] = {}
    if fleet:
        tables["fleet"] = {
            "redis_url_env": "SIDECAR_REDIS_URL",
            "key_prefix": "sidecar:",
            "sync_interval_ms": sync_ms,
            "open_quorum": quorum,
        }
    return config(
        server={"drain_timeout_ms": 200, **(server or {})},
        upstreams={
            "primary": upstream(
                primary_url, retry=retry, circuit_breaker=cb, **(primary_keys or {})
            ),
            "backup": upstream(backup_url, retry=retry),
        },
        routes=[route("chat", "primary", "backup", path_prefix="/v1/")],
        **tables,
    )


async def until(check: Callable[[], Awaitable[T | None]], what: str, limit_s: float = WAIT_S) -> T:
    """Poll ``check()`` (each poll is a real request, so it yields) until it returns a value.

    :raises AssertionError: not within ``limit_s`` seconds (names ``what``).
    """
    try:
        async with asyncio.timeout(limit_s):
            while True:
                last = await check()
                if last is not None and last is not False:
                    return last
                await asyncio.sleep(0.02)  # between polls of another process; bounded above
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None

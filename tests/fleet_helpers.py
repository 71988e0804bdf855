"""Shared set-up of the fleet's tests: a private Redis, fleet configs, bounded waits.

``redis_server`` starts a private ``redis-server`` (tests/redis_proc.py) for one test
and stops it after; the tests are skipped where the binary is missing (CI installs
Debian's ``redis-server`` package in ``.ci/run``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest
import pytest_asyncio

from tests.breaker_e2e_helpers import breaker, route, upstream
from tests.redis_proc import RedisProc, redis_server_path

WAIT_S = 10.0
"""Upper bound on a wait for a condition across processes (a failure, not a pace)."""

T = TypeVar("T")

needs_redis = pytest.mark.skipif(
    redis_server_path() is None, reason="redis-server not installed (apt-get install redis-server)"
)


@pytest_asyncio.fixture
async def redis_server() -> AsyncIterator[RedisProc]:
    """A private redis-server on a free loopback port, killed after the test."""
    proc = await RedisProc().start()
    try:
        yield proc
    finally:
        await proc.kill()


def fleet_table(*, sync_ms: int = 100, quorum: int = 1, prefix: str = "sidecar:") -> str:
    return (
        f'\n[fleet]\nredis_url_env = "SIDECAR_REDIS_URL"\nkey_prefix = "{prefix}"\n'
        f"sync_interval_ms = {sync_ms}\nopen_quorum = {quorum}\n"
    )


def chain_config(
    primary_url: str,
    backup_url: str,
    *,
    threshold: int = 1,
    cooldown_ms: int = 10_000,
    sync_ms: int = 100,
    quorum: int = 1,
    server: str = "",
    primary_extra: str = "",
) -> str:
    """Route "chat": primary (breaker, no retries), then backup (no breaker); with [fleet]."""
    return (
        f"[server]\ndrain_timeout_ms = 200\n{server}\n"
        + upstream(
            "primary",
            primary_url,
            breaker=breaker(threshold=threshold, cooldown_ms=cooldown_ms),
            extra=primary_extra,
        )
        + upstream("backup", backup_url, breaker=None)
        + route("chat", ["primary", "backup"])
        + fleet_table(sync_ms=sync_ms, quorum=quorum)
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

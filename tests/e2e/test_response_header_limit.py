"""Large upstream response headers (``max_response_header_bytes``, default 65536).

Contract ("The proxy port"): upstream response headers are accepted up to
``max_response_header_bytes`` per line and relayed; a head that breaks the limit
is a broken response (``stream_error``): retried, counted by the breaker, then the
next candidate. aiohttp's own default (8190 bytes) used to fail a healthy provider
whose CDN sent one long ``Set-Cookie``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream, Fault
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar, metric, status

KIB = 1024


def two_upstreams(primary: str, backup: str, limit: int | None) -> str:
    """``primary`` (2 retries, a threshold-1 breaker, ``max_response_header_bytes`` =
    ``limit`` unless None) then ``backup``, under one route."""
    keys: dict[str, Any] = {} if limit is None else {"max_response_header_bytes": limit}
    retry = {"max_retries": 2, "backoff_initial_ms": 1, "backoff_max_ms": 1}
    return config(
        upstreams={
            "primary": upstream(
                primary, retry=retry, circuit_breaker={"failure_threshold": 1}, **keys
            ),
            "backup": upstream(backup),
        },
        routes=[route("chat", "primary", "backup", path_prefix="/v1/")],
    )


@pytest_asyncio.fixture
async def big_client() -> AsyncIterator[aiohttp.ClientSession]:
    """A client that itself accepts long header lines (aiohttp's default is 8190 bytes)."""
    async with aiohttp.ClientSession(max_line_size=128 * KIB, max_field_size=128 * KIB) as s:
        yield s


async def attempts(http: aiohttp.ClientSession, sc: Sidecar) -> dict[str, float]:
    """The primary's attempts so far by outcome (the registry is process-wide: compare
    two readings)."""
    return {
        outcome: await metric(
            http, sc, "sidecar_upstream_attempts_total", upstream="primary", outcome=outcome
        )
        for outcome in ("success", "stream_error")
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize(
    ("limit", "size"),
    [(None, 16 * KIB), (None, 60 * KIB), (8 * KIB, 7 * KIB)],
    ids=["16KiB_default_limit", "60KiB_default_limit", "7KiB_under_8KiB"],
)
async def test_a_long_response_header_is_relayed_and_the_breaker_stays_closed(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    big_client: aiohttp.ClientSession,
    limit: int | None,
    size: int,
) -> None:
    cookie = "session=" + "c" * (size - len("session="))
    fake.set_default(Fault(headers={"Set-Cookie": cookie, "x-trace": "t" * 100}))
    sc = await start_sidecar(two_upstreams(fake.url, fake2.url, limit))
    before = await attempts(big_client, sc)
    async with big_client.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "primary"
        assert r.headers["x-sidecar-attempts"] == "1"
        assert r.headers.getall("Set-Cookie") == [cookie]
        assert r.headers["x-trace"] == "t" * 100
        assert (await r.json())["choices"][0]["message"]["content"]
    assert fake.request_count == 1 and fake2.request_count == 0
    assert (await status(big_client, sc))["primary/*"]["state"] == "closed"
    assert delta(await attempts(big_client, sc), before) == {"success": 1, "stream_error": 0}


@pytest.mark.parametrize(
    ("limit", "size"),
    [(None, 70 * KIB), (4 * KIB, 8 * KIB)],
    ids=["70KiB_default_limit", "8KiB_over_4KiB"],
)
async def test_a_header_over_the_limit_is_a_broken_response(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    big_client: aiohttp.ClientSession,
    limit: int | None,
    size: int,
) -> None:
    fake.set_default(Fault(headers={"Set-Cookie": "s=" + "c" * size}))
    sc = await start_sidecar(two_upstreams(fake.url, fake2.url, limit))
    before = await attempts(big_client, sc)
    async with big_client.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "backup"
        assert "Set-Cookie" not in r.headers
        await r.read()
    # The breaker (threshold 1) opened after the candidate call's 3 attempts.
    assert fake.request_count == 3 and fake2.request_count == 1
    assert delta(await attempts(big_client, sc), before) == {"success": 0, "stream_error": 3}
    entry = (await status(big_client, sc))["primary/*"]
    assert entry["state"] == "open" and entry["last_failure"] == "stream_error"

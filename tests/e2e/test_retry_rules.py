"""Retry rules beyond the relay tests: probes are never retried; every method is retried."""

from __future__ import annotations

import aiohttp

from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar, status


def with_backup(a: str, b: str) -> str:
    """``pr_primary`` (2 retries, breaker opens at 1 failure for 1 s), then ``pr_backup``."""
    return config(
        upstreams={
            "pr_primary": upstream(
                a,
                retry={"max_retries": 2, "backoff_initial_ms": 10},
                circuit_breaker={"failure_threshold": 1, "cooldown_ms": 1000},
            ),
            "pr_backup": upstream(b),
        },
        routes=[route("chat", "pr_primary", "pr_backup", path_prefix="/v1/")],
    )


async def test_failed_probe_is_one_request_and_reopens(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(with_backup(fake.url, fake2.url))
    fake.set_default(Fault(status=503))
    async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.headers["x-sidecar-attempts"] == "4"  # 3 on the primary (retried), 1 backup
    assert fake.request_count == 3
    assert (await status(http, sc))["pr_primary/*"]["state"] == "open"

    clock.advance(1.0)
    assert (await status(http, sc))["pr_primary/*"]["state"] == "half_open"
    async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "pr_backup"
        assert r.headers["x-sidecar-attempts"] == "2"  # the probe, then the backup
    assert fake.request_count == 4  # exactly one probe request, no retry
    assert (await status(http, sc))["pr_primary/*"]["state"] == "open"


async def test_any_method_is_retried_on_a_status(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """Retries apply to every method, not only aiohttp-retry's default list (e.g. QUERY)."""
    sc = await start_sidecar(with_backup(fake.url, fake2.url))
    fake.set_default(Fault(status=503))
    async with http.request("QUERY", sc.proxy_url + "/v1/echo/x", data=b"{}") as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "pr_backup"
        assert r.headers["x-sidecar-attempts"] == "4"
    assert fake.request_count == 3
    assert [q.method for q in fake.requests] == ["QUERY"] * 3

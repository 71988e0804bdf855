"""Breaker end to end: what counts, when it opens, what open means (behaviours 1-5).

The real sidecar on loopback in front of fake upstreams; breaker state is read
from ``GET /status?all=1`` on the admin port, upstream work from the fake's
request and TCP-accept counts. Time is the FakeClock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest

from sidecar.config import ConfigError, parse_config
from sidecar.testing import FakeUpstream, Fault
from tests.breaker_e2e_helpers import breaker_table, call, chain_upstream, entry, fail, start_chain
from tests.configs import config, route
from tests.conftest import StartSidecar, status

# -- 1. no circuit_breaker table ---------------------------------------------------------


async def test_no_breaker_table_every_request_pays_full_retries(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, None, fake2.url, retries=2)
    fake.set_default(Fault(status=503))
    for i in range(1, 8):
        r = await call(http, sc)
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "backup"
        assert r.headers["x-sidecar-attempts"] == "4"
        assert fake.request_count == 3 * i
        assert fake2.request_count == i
    assert await status(http, sc) == {}
    assert await status(http, sc, all_=False) == {}


# -- 2. validation ---------------------------------------------------------------------

BREAKER_KEYS = ["failure_threshold", "cooldown_ms", "half_open_max_probes", "success_threshold"]


def _config(cb: Mapping[str, Any]) -> str:
    """One upstream ``primary`` (never contacted) with breaker table ``cb``, one route."""
    return config(
        upstreams={"primary": chain_upstream("http://127.0.0.1:9", breaker=cb)},
        routes=[route("chat", "primary", path_prefix="/v1/")],
    )


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("key", BREAKER_KEYS)
def test_non_positive_breaker_setting_is_rejected_with_key_path(key: str, value: int) -> None:
    text = _config({key: value})
    with pytest.raises(ConfigError) as info:
        parse_config(text, {})
    path = f"upstreams.primary.circuit_breaker.{key}"
    assert [e for e in info.value.errors if e.startswith(path + ": ")], info.value.errors


def test_all_non_positive_settings_are_reported_together() -> None:
    text = _config(dict.fromkeys(BREAKER_KEYS, 0))
    with pytest.raises(ConfigError) as info:
        parse_config(text, {})
    for key in BREAKER_KEYS:
        path = f"upstreams.primary.circuit_breaker.{key}: "
        assert any(e.startswith(path) for e in info.value.errors), (key, info.value.errors)


def test_positive_breaker_settings_are_accepted() -> None:
    text = _config(breaker_table(1, 1, 1, 1))
    cb = parse_config(text, {}).upstreams["primary"].circuit_breaker
    assert cb is not None
    assert (cb.failure_threshold, cb.cooldown_ms, cb.half_open_max_probes) == (1, 1, 1)


# -- 3. one failure per candidate call, after its retries -------------------------------


async def test_three_attempts_make_one_failure(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_chain(
        start_sidecar, fake.url, breaker_table(threshold=3), fake2.url, retries=2
    )
    fake.set_default(Fault(status=503))
    r = await call(http, sc)
    assert r.status == 200
    assert r.headers["x-sidecar-attempts"] == "4"
    assert fake.request_count == 3
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"], e["last_failure"]) == ("closed", 1, "http_503")
    r = await call(http, sc)
    assert fake.request_count == 6
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 2)
    # The third call (three more attempts) is the third failure: it opens.
    await call(http, sc)
    assert fake.request_count == 9
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("open", 3)


# -- 4. threshold; success resets, caller errors are neutral ------------------------------


async def test_opens_after_threshold_consecutive_failures(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=3), fake2.url)
    for n in (1, 2):
        # The header fault reaches the backup too: its 503 is relayed after the fallback.
        r = await call(http, sc, fault=fail(503))
        assert (r.status, r.headers["x-sidecar-upstream"]) == (503, "backup")
        e = await entry(http, sc)
        assert (e["state"], e["consecutive_failures"]) == ("closed", n)
        assert await status(http, sc, all_=False) == {}
    await call(http, sc, fault=fail(503))
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("open", 3)
    assert list(await status(http, sc, all_=False)) == ["primary/*"]


@pytest.mark.parametrize("success", [{"status": 200}, {"status": 201}, {"status": 302}])
async def test_success_resets_the_count(
    success: dict[str, int],
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=3), fake2.url)
    await call(http, sc, fault=fail(503))
    await call(http, sc, fault=fail(500))
    assert (await entry(http, sc))["consecutive_failures"] == 2
    r = await call(http, sc, fault=success)
    assert r.status == success["status"]
    assert r.headers["x-sidecar-upstream"] == "primary"
    assert (await entry(http, sc))["consecutive_failures"] == 0
    # Two more failures do not reach the threshold of 3: the count really restarted.
    await call(http, sc, fault=fail(503))
    await call(http, sc, fault=fail(503))
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 2)


async def test_caller_error_between_failures_neither_counts_nor_resets(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_chain(start_sidecar, fake.url, breaker_table(threshold=3), fake2.url)
    await call(http, sc, fault=fail(503))
    await call(http, sc, fault=fail(503))
    r = await call(http, sc, fault=fail(400))
    assert r.status == 400  # the caller's error, relayed, no fallback
    assert r.headers["x-sidecar-upstream"] == "primary"
    assert fake2.request_count == 2
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 2)
    await call(http, sc, fault=fail(503))
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("open", 3)


# -- 5. open: no connection, no request; the next candidate at once ----------------------


async def test_open_target_is_not_contacted_and_backup_answers_at_once(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_chain(
        start_sidecar, fake.url, breaker_table(threshold=2), fake2.url, retries=2
    )
    fake.set_default(Fault(status=503))
    for _ in range(2):
        r = await call(http, sc)
        assert r.headers["x-sidecar-attempts"] == "4"
    assert (await entry(http, sc))["state"] == "open"
    requests, accepted = fake.request_count, fake.connections_accepted
    backup_before = fake2.request_count
    for i in range(1, 6):
        r = await call(http, sc)
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "backup"
        assert r.headers["x-sidecar-attempts"] == "1"
        assert fake2.request_count == backup_before + i
    assert fake.request_count == requests
    assert fake.connections_accepted == accepted

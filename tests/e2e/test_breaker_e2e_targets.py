"""Breaker end to end: targets, failure kinds, /status, logs, metrics (behaviours 13-15).

Real fake upstreams on loopback, refused and hanging connects from
:func:`closed_port` / :func:`saturated_listener`, FakeClock time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from sidecar.logs import JsonFormatter
from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault, closed_port, saturated_listener
from tests.breaker_e2e_helpers import (
    SERVER_TABLE,
    assert_at,
    breaker_table,
    call,
    chain_upstream,
    entry,
    fail,
    start_chain,
    until_fake,
)
from tests.configs import config, route
from tests.conftest import StartSidecar, metric, on_fake_time, status


@pytest_asyncio.fixture
async def fake3() -> AsyncIterator[FakeUpstream]:
    """A third fake upstream ("other")."""
    async with FakeUpstream() as f:
        yield f


# -- 13. one breaker per target --------------------------------------------------------


async def test_two_models_on_one_upstream_have_separate_breakers(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(
        config(
            server=SERVER_TABLE,
            upstreams={"primary": chain_upstream(fake.url, breaker=breaker_table(threshold=1))},
            routes=[
                route(
                    "chat",
                    {"upstream": "primary", "model": "gpt-4o"},
                    {"upstream": "primary", "model": "gpt-4o-mini"},
                    path_prefix="/v1/",
                )
            ],
        )
    )
    fake.script_for_model("gpt-4o", [Fault(status=503)])
    r = await call(http, sc, model="smart")
    assert (r.status, r.headers["x-sidecar-attempts"]) == (200, "2")
    assert [q.model for q in fake.requests] == ["gpt-4o", "gpt-4o-mini"]
    s = await status(http, sc)
    assert (s["primary/gpt-4o"]["state"], s["primary/gpt-4o-mini"]["state"]) == ("open", "closed")
    assert list(await status(http, sc, all_=False)) == ["primary/gpt-4o"]
    # The same upstream is still used for the other model, and only for it.
    for _ in range(3):
        r = await call(http, sc, model="smart")
        assert (r.status, r.headers["x-sidecar-attempts"]) == (200, "1")
        assert fake.requests[-1].model == "gpt-4o-mini"
    assert fake.request_count == 5
    assert (await entry(http, sc, "primary/gpt-4o-mini"))["consecutive_failures"] == 0


async def test_upstreams_are_independent_and_routes_share_a_target(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    fake3: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(
        config(
            server=SERVER_TABLE,
            upstreams={
                "primary": chain_upstream(fake.url, breaker=breaker_table(threshold=2)),
                "other": chain_upstream(fake3.url, breaker=breaker_table(threshold=2)),
                "backup": chain_upstream(fake2.url, breaker=None),
            },
            routes=[
                route("route_a", "primary", "backup", path_prefix="/v1/a/"),
                route("route_b", "primary", "backup", path_prefix="/v1/b/"),
                route("route_c", "other", "backup", path_prefix="/v1/c/"),
            ],
        )
    )
    fake.set_default(Fault(status=503))
    fake3.set_default(Fault(status=503))
    # One failure through each route that uses primary: they add up on one breaker.
    await call(http, sc, "/v1/a/chat/completions")
    await call(http, sc, "/v1/b/chat/completions")
    await call(http, sc, "/v1/c/chat/completions")
    s = await status(http, sc)
    assert set(s) == {"primary/*", "other/*"}
    assert (s["primary/*"]["state"], s["primary/*"]["consecutive_failures"]) == ("open", 2)
    assert (s["other/*"]["state"], s["other/*"]["consecutive_failures"]) == ("closed", 1)
    # Open for route_b too, though it was opened through route_a and route_b together.
    before = fake.request_count
    for path in ("/v1/a/x", "/v1/b/x"):
        r = await call(http, sc, path)
        assert (r.headers["x-sidecar-upstream"], r.headers["x-sidecar-attempts"]) == ("backup", "1")
    assert fake.request_count == before
    # The other upstream is still tried (and its own count goes on).
    before3 = fake3.request_count
    fake3.set_default(Fault())
    r = await call(http, sc, "/v1/c/x")
    assert r.headers["x-sidecar-upstream"] == "other"
    assert fake3.request_count == before3 + 1
    assert (await entry(http, sc, "other/*"))["consecutive_failures"] == 0


# -- 14. transport failures count and fall back --------------------------------------------

KINDS = [
    "refused",
    "connect_timeout",
    "reset_after_headers",
    "reset_before_headers",
    "first_byte",
    "503",
]
EXPECTED = {
    "refused": "connect_error",
    "connect_timeout": "connect_error",
    "reset_after_headers": "stream_error",
    "reset_before_headers": "stream_error",
    "first_byte": "timeout",
    "503": "http_503",
}


@pytest.mark.parametrize("kind", KINDS)
async def test_failure_kinds_count_and_fall_back(
    kind: str,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    url, cleanup = fake.url, None
    if kind == "refused":
        url = f"http://127.0.0.1:{closed_port()}"
    elif kind == "connect_timeout":
        host, port, cleanup = await saturated_listener()
        url = f"http://{host}:{port}"
    else:
        fake.set_default(
            {
                "reset_after_headers": Fault(reset_after_headers=True),
                "reset_before_headers": Fault(reset_before_headers=True),
                "first_byte": Fault(stall=True),
                "503": Fault(status=503),
            }[kind]
        )
    first_byte_ms = 100 if kind == "first_byte" else 5000
    try:
        sc = await start_chain(
            start_sidecar,
            url,
            breaker_table(threshold=2),
            fake2.url,
            retries=1,
            # Apart, so that the connect timeout cannot race the first-byte one.
            primary_keys={"connect_timeout_ms": 100, "first_byte_timeout_ms": first_byte_ms},
        )
        # The first-byte timeout runs on the fake clock: advanced once the fake holds it.
        timed = kind == "first_byte"
        r = await on_fake_time(clock, fake, [(1, 0.1)] if timed else [], call(http, sc))
        retried = kind != "first_byte"  # a first-byte timeout is not retried by default
        assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
        assert r.headers["x-sidecar-attempts"] == ("3" if retried else "2")
        e = await entry(http, sc)
        assert (e["state"], e["consecutive_failures"], e["last_failure"]) == (
            "closed",
            1,
            EXPECTED[kind],
        )
        await on_fake_time(
            clock, fake, [(fake.request_count + 1, 0.1)] if timed else [], call(http, sc)
        )
        e = await entry(http, sc)
        assert (e["state"], e["consecutive_failures"], e["last_failure"]) == (
            "open",
            2,
            EXPECTED[kind],
        )
        accepted, requests = fake.connections_accepted, fake.request_count
        r = await call(http, sc)
        assert (r.headers["x-sidecar-upstream"], r.headers["x-sidecar-attempts"]) == ("backup", "1")
        assert (fake.connections_accepted, fake.request_count) == (accepted, requests)
    finally:
        fake.release()
        if cleanup is not None:
            cleanup()


# -- 15. /status and the transition logs ------------------------------------------------

FIELDS = {
    "upstream",
    "model",
    "state",
    "consecutive_failures",
    "opened_at",
    "retry_at",
    "probes_in_flight",
    "last_failure",
}


async def test_status_lists_open_and_half_open_and_all_lists_every_target(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession, clock: FakeClock
) -> None:
    sc = await start_sidecar(
        config(
            server=SERVER_TABLE,
            upstreams={
                "up_a": chain_upstream(
                    fake.url, breaker=breaker_table(threshold=1, cooldown_ms=1000)
                ),
                "up_b": chain_upstream(  # a 429 opens the target: rate limits scoped to it
                    fake.url,
                    breaker=breaker_table(threshold=1, cooldown_ms=5000),
                    rate_limit_scope="target",
                ),
                "up_c": chain_upstream(fake.url, breaker=breaker_table(threshold=1)),
                "up_d": chain_upstream(fake.url, breaker=None),
            },
            routes=[
                route("ra", {"upstream": "up_a", "model": "gpt-4o"}, path_prefix="/v1/a/"),
                route("rb", "up_b", path_prefix="/v1/b/"),
                route("rc", "up_c", path_prefix="/v1/c/"),
                route("rd", "up_d", path_prefix="/v1/d/"),
            ],
        ),
    )
    t0 = clock.now()
    await call(http, sc, "/v1/a/x", fault=fail(502))
    await call(http, sc, "/v1/b/x", fault=fail(429))
    clock.advance(1.0)
    async with http.get(sc.admin_url + "/status") as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        doc = await resp.json()
    assert set(doc) == {"breakers"}
    by_key = {f"{b['upstream']}/{b['model']}": b for b in doc["breakers"]}
    assert set(by_key) == {"up_a/gpt-4o", "up_b/*"}
    a, b = by_key["up_a/gpt-4o"], by_key["up_b/*"]
    assert set(a) == FIELDS and set(b) == FIELDS
    assert (a["state"], a["consecutive_failures"], a["probes_in_flight"], a["last_failure"]) == (
        "half_open",
        1,
        0,
        "http_502",
    )
    assert (b["state"], b["consecutive_failures"], b["probes_in_flight"], b["last_failure"]) == (
        "open",
        1,
        0,
        "http_429",
    )
    for e, cooldown in ((a, 1.0), (b, 5.0)):
        assert e["opened_at"].endswith(("Z", "+00:00"))
        assert_at(e["opened_at"], clock, t0)
        assert_at(e["retry_at"], clock, t0 + cooldown)
    every = await status(http, sc)
    assert set(every) == {"up_a/gpt-4o", "up_b/*", "up_c/*"}  # up_d has no breaker
    c = every["up_c/*"]
    assert set(c) == FIELDS
    assert (c["state"], c["consecutive_failures"], c["opened_at"], c["retry_at"]) == (
        "closed",
        0,
        None,
        None,
    )
    assert (c["probes_in_flight"], c["last_failure"]) == (0, None)


BREAKER_EVENTS = ("breaker_opened", "breaker_half_open", "breaker_closed")


async def test_transitions_are_logged_once_as_json_without_secrets(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar")
    key = "sk-test-Zq7SECRETKEY"
    sc = await start_sidecar(
        config(
            server=SERVER_TABLE,
            upstreams={
                "primary": chain_upstream(
                    fake.url,
                    breaker=breaker_table(threshold=2, cooldown_ms=3000),
                    api_key_env="PRIMARY_KEY",
                )
            },
            routes=[route("chat", {"upstream": "primary", "model": "gpt-4o"}, path_prefix="/v1/")],
        ),
        environ={"PRIMARY_KEY": key},
    )
    prompt = {"model": "m", "messages": [{"role": "user", "content": "PROMPT-SECRET-31"}]}
    bad = fail(503, body="RESPONSE-SECRET-47")
    await call(http, sc, body=prompt, fault=bad, headers={"authorization": "Bearer client-tok"})
    t_open = clock.now()
    await call(http, sc, body=prompt, fault=bad)
    assert fake.requests[-1].headers["authorization"] == f"Bearer {key}"  # the key was used
    clock.advance(3.0)
    assert (await call(http, sc, body=prompt)).status == 200
    records = [
        r for r in caplog.records if r.name == "sidecar" and r.getMessage() in BREAKER_EVENTS
    ]
    lines = [JsonFormatter().format(r) for r in records]
    docs = [json.loads(line) for line in lines]
    assert [d["event"] for d in docs] == list(BREAKER_EVENTS)
    for d in docs:
        assert {
            "ts",
            "level",
            "upstream",
            "model",
            "consecutive_failures",
            "last_failure",
            "retry_at",
        } <= set(d)
        assert (d["upstream"], d["model"], d["level"]) == ("primary", "gpt-4o", "info")
    opened, half, closed = docs
    assert (opened["consecutive_failures"], opened["last_failure"]) == (2, "http_503")
    assert_at(opened["retry_at"], clock, t_open + 3.0)
    assert half["consecutive_failures"] == 2
    assert_at(half["retry_at"], clock, t_open + 3.0)
    assert (closed["consecutive_failures"], closed["retry_at"]) == (0, None)
    for line in lines:
        for secret in (key, "client-tok", "Bearer", "PROMPT-SECRET", "RESPONSE-SECRET", fake.url):
            assert secret not in line
        assert "127.0.0.1" not in line and str(fake.port) not in line


# -- metrics agree with the state ----------------------------------------------------------


async def _one_hot(http: aiohttp.ClientSession, sc: Sidecar, up: str) -> dict[str, float]:
    return {
        s: await metric(http, sc, "sidecar_breaker_state", upstream=up, model="*", state=s)
        for s in ("closed", "open", "half_open")
    }


async def test_metrics_agree_with_breaker_state(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    up = "metrics_e2e_up"
    sc = await start_sidecar(
        config(
            server=SERVER_TABLE,
            upstreams={
                up: chain_upstream(fake.url, breaker=breaker_table(threshold=1, cooldown_ms=1000)),
                "metrics_e2e_backup": chain_upstream(fake2.url, breaker=None),
            },
            routes=[route("metrics_e2e_route", up, "metrics_e2e_backup", path_prefix="/v1/")],
        )
    )

    async def counts() -> tuple[float, float, float, float]:
        t = [
            await metric(
                http, sc, "sidecar_breaker_transitions_total", upstream=up, model="*", to=s
            )
            for s in ("open", "half_open", "closed")
        ]
        rej = await metric(http, sc, "sidecar_breaker_rejections_total", upstream=up, model="*")
        return t[0], t[1], t[2], rej

    o0, h0, c0, r0 = await counts()
    assert await _one_hot(http, sc, up) == {"closed": 1, "open": 0, "half_open": 0}
    fake.set_default(Fault(status=503))
    await call(http, sc)
    assert await _one_hot(http, sc, up) == {"closed": 0, "open": 1, "half_open": 0}
    for _ in range(3):
        assert (await call(http, sc)).headers["x-sidecar-upstream"] == "metrics_e2e_backup"
    assert await counts() == (o0 + 1, h0, c0, r0 + 3)
    clock.advance(1.0)  # counted when the timer fires, with no request
    assert await _one_hot(http, sc, up) == {"closed": 0, "open": 0, "half_open": 1}
    assert await counts() == (o0 + 1, h0 + 1, c0, r0 + 3)
    await call(http, sc)  # the probe fails: reopened
    assert await _one_hot(http, sc, up) == {"closed": 0, "open": 1, "half_open": 0}
    assert await counts() == (o0 + 2, h0 + 1, c0, r0 + 3)
    clock.advance(1.0)
    gate = asyncio.Event()
    fake.set_default(Fault(hold_first_chunk=gate))
    probe = asyncio.create_task(call(http, sc))
    try:
        await until_fake(fake, lambda: fake.active_requests == 1)
        for _ in range(2):  # skipped while the one probe slot is taken
            assert (await call(http, sc)).headers["x-sidecar-upstream"] == "metrics_e2e_backup"
    finally:
        gate.set()
    assert (await probe).headers["x-sidecar-upstream"] == up
    assert await _one_hot(http, sc, up) == {"closed": 1, "open": 0, "half_open": 0}
    assert await counts() == (o0 + 2, h0 + 2, c0 + 1, r0 + 5)

"""Issue 12, items 3 to 6: context windows, slow calls, rate limits, client retries.

Through the running sidecar with the fake upstream's byte-exact provider bodies,
and the official openai and anthropic SDKs as clients. Time moves only by
``clock.advance``; the sidecar's retry backoff sleeps on the fake clock.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault, closed_port, error_shapes
from tests import configs
from tests.breaker_e2e_helpers import (
    SERVER_TABLE,
    breaker_table,
    call,
    chain_upstream,
    entry,
    fail,
)
from tests.configs import route
from tests.conftest import StartSidecar, metric

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
WAIT_S = 5.0
Http = aiohttp.ClientSession
THRESHOLD_2 = breaker_table(threshold=2)
NO_KEYS: Mapping[str, Any] = MappingProxyType({})


def config(
    primary: str,
    backup: str | None = None,
    *,
    retries: int = 0,
    cb: Mapping[str, Any] | None = THRESHOLD_2,
    backup_cb: Mapping[str, Any] | None = None,
    route_keys: Mapping[str, Any] = NO_KEYS,
    retry_keys: Mapping[str, Any] = NO_KEYS,
    server: Mapping[str, Any] = SERVER_TABLE,
    scope: Mapping[str, Any] = NO_KEYS,
) -> str:
    """Route "chat" (no path prefix, ``route_keys``): ``primary`` (breaker ``cb``, None:
    none; ``retries`` and ``retry_keys``), then ``backup`` (breaker ``backup_cb``);
    ``scope``: more keys of both upstreams (``rate_limit_scope``)."""
    upstreams = {
        "primary": chain_upstream(
            primary, breaker=cb, retries=retries, retry_keys=retry_keys, **scope
        )
    }
    if backup is not None:
        upstreams["backup"] = chain_upstream(backup, breaker=backup_cb, **scope)
    return configs.config(
        server=server, upstreams=upstreams, routes=[route("chat", *upstreams, **route_keys)]
    )


# -- 3. context-window overflow ------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "path"), [("openai_context_window", CHAT), ("anthropic_context_window", MESSAGES)]
)
async def test_context_window_400_moves_on_never_retried_and_neutral(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    shape: str,
    path: str,
) -> None:
    # 400 is even listed as retried here: a context-window 400 is still never retried.
    sc = await start_sidecar(
        config(fake.url, fake2.url, retries=2, retry_keys={"statuses": [400, 503]})
    )
    fake.set_default(Fault(shape=shape))
    r = await call(http, sc, path)
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
    assert (fake.request_count, fake2.request_count) == (1, 1)
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)
    # The last candidate's context-window answer is relayed as it came.
    fake2.set_default(Fault(shape=shape))
    r = await call(http, sc, path)
    want = error_shapes.render_shape(shape, "m", "x").chunks[0]
    assert (r.status, r.headers["x-sidecar-upstream"], r.body) == (400, "backup", want)
    assert "x-should-retry" not in r.headers  # a caller's answer


async def test_context_window_fallback_false_relays_it_at_once(
    fake: FakeUpstream, fake2: FakeUpstream, start_sidecar: StartSidecar, http: Http
) -> None:
    sc = await start_sidecar(
        config(fake.url, fake2.url, route_keys={"context_window_fallback": False})
    )
    fake.set_default(Fault(shape="openai_context_window"))
    r = await call(http, sc)
    assert (r.status, r.headers["x-sidecar-upstream"]) == (400, "primary")
    assert r.body == error_shapes.openai_context_window_body()
    assert (fake.request_count, fake2.request_count) == (1, 0)


async def test_a_plain_400_is_relayed_at_once(
    fake: FakeUpstream, fake2: FakeUpstream, start_sidecar: StartSidecar, http: Http
) -> None:
    sc = await start_sidecar(config(fake.url, fake2.url, retries=2))
    r = await call(http, sc, fault=fail(400))
    assert (r.status, r.headers["x-sidecar-upstream"]) == (400, "primary")
    assert (fake.request_count, fake2.request_count) == (1, 0)


# -- 4. slow_call_ms -------------------------------------------------------------------------


async def slow_call(
    http: aiohttp.ClientSession, sc: Sidecar, fake: FakeUpstream, clock: FakeClock, s: float
) -> bytes:
    """One call whose first body chunk comes ``s`` seconds (fake clock) after it was sent."""
    gate = asyncio.Event()
    fake.script([Fault(hold_first_chunk=gate)])
    n = fake.request_count + 1
    task = asyncio.ensure_future(call(http, sc))
    async with asyncio.timeout(WAIT_S):
        await fake.wait_for_requests(n)
    clock.advance(s)
    gate.set()
    r = await task
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
    assert r.json()["object"] == "chat.completion"
    return r.body


async def test_slow_success_is_relayed_and_counts_a_fast_one_resets(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession, clock: FakeClock
) -> None:
    cb = breaker_table(threshold=3, slow_call_ms=2000)
    sc = await start_sidecar(config(fake.url, cb=cb))
    slow = "sidecar_slow_calls_total"
    before = await metric(http, sc, slow, upstream="primary", model="*")
    await slow_call(http, sc, fake, clock, 2.5)
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"], e["last_failure"]) == ("closed", 1, "slow_call")
    await slow_call(http, sc, fake, clock, 1.9)  # under slow_call_ms: a success, resets
    assert (await entry(http, sc))["consecutive_failures"] == 0
    for _ in range(3):
        await slow_call(http, sc, fake, clock, 3.0)
    e = await entry(http, sc)
    assert (e["state"], e["last_failure"]) == ("open", "slow_call")
    assert await metric(http, sc, slow, upstream="primary", model="*") == before + 4


# -- 5. every candidate open on rate limits: 429 rate_limited ------------------------------------


async def rate_limited_sidecar(
    fake: FakeUpstream, fake2: FakeUpstream, start_sidecar: StartSidecar, http: Http
) -> Sidecar:
    # Rate limits scoped to the targets (the SDKs below send other keys than the first
    # call, which would not be skipped with rate_limit_scope = "credential").
    sc = await start_sidecar(
        config(
            fake.url,
            fake2.url,
            cb=breaker_table(threshold=1),
            backup_cb=breaker_table(threshold=1),
            scope={"rate_limit_scope": "target"},
        )
    )
    r = await call(http, sc, fault=fail(429))  # both candidates answer 429: both open
    assert (r.status, r.headers["x-sidecar-upstream"]) == (429, "backup")
    return sc


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
async def test_every_candidate_open_on_rate_limits_answers_429_rate_limited(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    path: str,
) -> None:
    sc = await rate_limited_sidecar(fake, fake2, start_sidecar, http)
    sent = fake.request_count + fake2.request_count
    r = await call(http, sc, path)
    assert r.status == 429
    assert r.headers["x-sidecar-error"] == "rate_limited"
    assert r.headers["Retry-After"] == "10"
    assert r.headers["x-should-retry"] == "false"
    doc = r.json()
    if path == MESSAGES:
        assert doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error"
    else:
        assert (doc["error"]["type"], doc["error"]["code"]) == ("rate_limited", "rate_limited")
    assert fake.request_count + fake2.request_count == sent  # no upstream contacted


async def test_one_candidate_open_on_other_failures_answers_503_circuit_open(
    fake: FakeUpstream, fake2: FakeUpstream, start_sidecar: StartSidecar, http: Http
) -> None:
    sc = await start_sidecar(
        config(
            fake.url, fake2.url, cb=breaker_table(threshold=1), backup_cb=breaker_table(threshold=1)
        )
    )
    fake.script([Fault(status=503)])
    fake2.script([Fault(status=429)])
    assert (await call(http, sc)).status == 429
    r = await call(http, sc)
    assert (r.status, r.headers["x-sidecar-error"]) == (503, "circuit_open")


async def test_sdks_raise_their_rate_limit_error(
    fake: FakeUpstream, fake2: FakeUpstream, start_sidecar: StartSidecar, http: Http
) -> None:
    sc = await rate_limited_sidecar(fake, fake2, start_sidecar, http)
    answered = "sidecar_requests_total"
    before = await metric(http, sc, answered, route="chat", code="429")
    oai = openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key="sk-test")  # max_retries=2
    with pytest.raises(openai.RateLimitError) as o_err:
        await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert o_err.value.response.headers["x-sidecar-error"] == "rate_limited"
    ant = anthropic.AsyncAnthropic(base_url=sc.proxy_url, api_key="sk-ant-test")
    with pytest.raises(anthropic.RateLimitError) as a_err:
        await ant.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert a_err.value.response.headers["x-sidecar-error"] == "rate_limited"
    # x-should-retry: false: neither SDK retried (nor slept the Retry-After).
    assert await metric(http, sc, answered, route="chat", code="429") == before + 2
    await oai.close()
    await ant.close()


# -- 6. client retries: x-should-retry: false exactly where the contract says ---------------------


async def test_openai_sdk_default_retries_make_exactly_the_sidecars_attempts(
    fake: FakeUpstream, start_sidecar: StartSidecar
) -> None:
    sc = await start_sidecar(config(fake.url, cb=None, retries=2))
    fake.set_default(Fault(status=503))
    client = openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key="sk-test")
    assert client.max_retries == 2
    with pytest.raises(openai.InternalServerError) as err:
        await client.chat.completions.create(model="m", messages=[])
    await client.close()
    assert err.value.response.headers["x-should-retry"] == "false"
    assert fake.request_count == 1 + 2  # 1 + retry.max_retries, not 3 x 3


async def test_x_should_retry_false_exactly_where_the_contract_says(
    fake: FakeUpstream, fake2: FakeUpstream, start_sidecar: StartSidecar, http: Http
) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    sc = await start_sidecar(
        configs.config(
            server={**SERVER_TABLE, "max_concurrent_requests": 1},
            upstreams={
                "primary": chain_upstream(fake.url, breaker=breaker_table(threshold=1), retries=1),
                "single": chain_upstream(fake2.url, breaker=None),
                "dead": chain_upstream(dead, breaker=None),
            },
            routes=[
                route("chat", "primary", path_prefix="/v1/"),
                route("one", "single", path_prefix="/one/"),
                route("d", "dead", path_prefix="/dead/"),
            ],
        )
    )

    async def hint(path: str, **fault: object) -> str | None:
        r = await call(http, sc, path, fault=dict(fault) if fault else None)
        return r.headers.get("x-should-retry")

    assert await hint("/one/chat/completions") is None  # a success
    assert await hint("/one/chat/completions", status=400) is None  # a caller's answer
    assert await hint("/one/chat/completions", status=503) is None  # no retry, no fallback
    assert await hint("/dead/x") == "false"  # the sidecar's own upstream_unavailable
    assert await hint(CHAT, status=503) == "false"  # relayed after the sidecar's retry
    assert await hint(CHAT) == "false"  # circuit_open (the 503 opened the breaker)
    # overloaded: a later try may pass
    gate = asyncio.Event()
    fake2.script([Fault(hold_headers=gate)])
    held = asyncio.ensure_future(call(http, sc, "/one/chat/completions"))
    async with asyncio.timeout(WAIT_S):
        await fake2.wait_for_requests(fake2.request_count + 1)
    r = await call(http, sc, "/one/chat/completions")
    assert (r.headers["x-sidecar-error"], r.headers.get("x-should-retry")) == ("overloaded", None)
    gate.set()
    assert (await held).status == 200


async def test_client_retry_hint_false_sends_no_hint(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    server = {**SERVER_TABLE, "client_retry_hint": False}
    sc = await start_sidecar(
        config(fake.url, cb=breaker_table(threshold=1), retries=1, server=server)
    )
    r = await call(http, sc, fault=fail(503))
    assert (r.status, r.headers.get("x-should-retry")) == (503, None)
    r = await call(http, sc)
    assert (r.headers["x-sidecar-error"], r.headers.get("x-should-retry")) == ("circuit_open", None)
    assert json.loads(r.body)["error"]["code"] == "circuit_open"

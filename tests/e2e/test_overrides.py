"""Operators' overrides end to end: ``POST /breakers/{upstream}/{model}`` on the admin port.

Contract, "The admin port": token from ``server.admin_token_env`` (absent: the endpoint
does not exist), 401 for a missing or wrong one (never logged), 400 for a bad body, 404
for an unknown target; ``force_open`` skips the target as if open with no probe,
``force_closed`` admits it whatever its failures (still counted), ``auto`` hands it back
closed with its counts reset, ``for_ms`` ends an override by itself (on the fake clock).
Each test sees what an operator sees: the answer, ``/status``, ``/metrics``, the log
lines, and real traffic through the sidecar to fake upstreams on loopback.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from sidecar.logs import JsonFormatter
from sidecar.reload import reload_runtime
from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests import configs
from tests.access_log_helpers import Lines, capture
from tests.breaker_e2e_helpers import (
    SERVER_TABLE,
    assert_at,
    breaker_table,
    call,
    chain_upstream,
    entry,
    fail,
)
from tests.conftest import StartSidecar, metric, status

TOKEN = "adm-tok-8f3Kq93SECRET"
WRONG = "adm-wrong-Zx81NOTIT"
TOKEN_VAR = "SIDECAR_TEST_ADMIN_TOKEN"
ENV = {TOKEN_VAR: TOKEN}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def override_config(
    primary: str,
    backup: str | None = None,
    *,
    token_env: str = TOKEN_VAR,
    cb: dict[str, Any] | None = None,
    model: str | None = None,
    **primary_keys: Any,
) -> str:
    """Route ``chat``: ``primary`` (breaker ``cb``, threshold 1 and cooldown 10 s unless
    given; candidate ``model`` if given), then ``backup`` (no breaker) when given."""
    upstreams = {"primary": chain_upstream(primary, breaker=cb or breaker_table(), **primary_keys)}
    first: str | dict[str, str] = "primary"
    if model is not None:
        first = {"upstream": "primary", "model": model}
    chain: list[str | dict[str, str]] = [first]
    if backup is not None:
        upstreams["backup"] = chain_upstream(backup, breaker=None)
        chain.append("backup")
    return configs.config(
        server={**SERVER_TABLE, "admin_token_env": token_env},
        upstreams=upstreams,
        routes=[configs.route("chat", *chain, path_prefix="/v1/")],
    )


async def post_override(
    http: aiohttp.ClientSession,
    sc: Sidecar,
    body: Any,
    path: str = "primary/%2A",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """POST ``body`` (JSON; bytes as they are) to the admin port: (status, JSON or text)."""
    h = AUTH if headers is None else headers
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(f"{sc.admin_url}/breakers/{path}", data=data, headers=h) as r:
        text = await r.text()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


PRIMARY = {"upstream": "primary", "model": "*"}


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client with a new connection per request: these tests move the fake clock past
    ``client_read_timeout_ms``, which closes an idle kept-alive connection."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(auto_decompress=False, connector=connector) as s:
        yield s


async def counters(http: aiohttp.ClientSession, sc: Sidecar) -> dict[str, float]:
    """The counters of ``primary/*`` these tests read (the registry is process-wide:
    tests compare deltas)."""
    out = {
        action: await metric(http, sc, "sidecar_breaker_overrides_total", **PRIMARY, action=action)
        for action in ("force_open", "force_closed", "auto")
    }
    out["rejections"] = await metric(http, sc, "sidecar_breaker_rejections_total", **PRIMARY)
    out["fallbacks"] = await metric(
        http, sc, "sidecar_fallbacks_total", route="chat", upstream="primary", reason="circuit_open"
    )
    return out


async def delta(
    http: aiohttp.ClientSession, sc: Sidecar, before: dict[str, float]
) -> dict[str, float]:
    now = await counters(http, sc)
    return {k: now[k] - before[k] for k in now}


async def active(http: aiohttp.ClientSession, sc: Sidecar, action: str) -> float:
    """``sidecar_breaker_override_active`` of ``primary/*`` for ``action``."""
    return await metric(http, sc, "sidecar_breaker_override_active", **PRIMARY, action=action)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every log record of the test as the JSON line it is written as."""
    return [JsonFormatter().format(r) for r in caplog.records]


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    out = [json.loads(x) for x in lines(caplog)]
    return [d for d in out if d.get("event") == name]


# -- the endpoint's gate ----------------------------------------------------------------


@pytest.mark.parametrize("token_env", ["", "SIDECAR_TEST_UNSET_TOKEN"])
async def test_without_a_set_token_variable_the_endpoint_does_not_exist(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    token_env: str,
) -> None:
    sc = await start_sidecar(override_config(fake.url, token_env=token_env), environ={})
    body = {"action": "force_open", "reason": "maintenance"}
    assert await post_override(http, sc, body) == (404, "404: Not Found")
    async with http.get(f"{sc.admin_url}/breakers/primary/%2A", headers=AUTH) as r:
        assert r.status == 404
    async with http.get(f"{sc.admin_url}/breakers/nope/x") as r:
        assert r.status == 404
    assert "override" not in await entry(http, sc)


async def test_a_named_but_unset_variable_is_a_warning_at_start(
    fake: FakeUpstream, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar")
    await start_sidecar(override_config(fake.url), environ={})
    [warned] = [w for w in events(caplog, "config_warning") if w["key"] == "server.admin_token_env"]
    assert warned["level"] == "warning"
    assert TOKEN_VAR in warned["detail"] and "does not exist" in warned["detail"]
    caplog.clear()
    await start_sidecar(override_config(fake.url), environ=ENV)
    assert events(caplog, "config_warning") == []


async def test_a_set_but_empty_variable_is_no_token(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(override_config(fake.url), environ={TOKEN_VAR: ""})
    got = await post_override(http, sc, {"action": "auto"}, headers={"Authorization": "Bearer "})
    assert got[0] == 404


async def test_a_missing_or_wrong_token_is_401_and_no_token_is_ever_logged(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    sc = await start_sidecar(override_config(fake.url), environ=ENV)
    body = {"action": "force_open", "reason": "maintenance"}
    refused = [
        {},
        {"Authorization": f"Bearer {WRONG}"},
        {"Authorization": TOKEN},  # no scheme
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
    ]
    for headers in refused:
        got = await post_override(http, sc, body, headers=headers)
        assert got[0] == 401, headers
        assert got[1]["error"]["code"] == "unauthorized"
    async with http.post(f"{sc.admin_url}/breakers/primary/%2A", json=body) as r:
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    # Refused: nothing changed.
    e = await entry(http, sc)
    assert (e["state"], "override" in e) == ("closed", False)
    assert (await call(http, sc)).status == 200
    # The scheme's name is case-insensitive (RFC 9110 section 11.1).
    got = await post_override(http, sc, body, headers={"authorization": f"bearer {TOKEN}"})
    assert got[0] == 200
    assert len(events(caplog, "admin_unauthorized")) == len(refused) + 1
    everything = "\n".join(lines(caplog))
    assert TOKEN not in everything and WRONG not in everything
    assert TOKEN[:-1] not in everything


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "JSON"),
        ([], "object"),
        ({"action": "force_opened", "reason": "x"}, "action must be one of"),
        ({"reason": "x"}, "action must be one of"),
        ({"action": "force_open"}, "reason is required"),
        ({"action": "force_closed", "reason": "   "}, "reason is required"),
        ({"action": "force_open", "reason": 5}, "reason must be a string"),
        ({"action": "force_open", "reason": "x", "for_ms": 0}, "for_ms must be > 0"),
        ({"action": "force_open", "reason": "x", "for_ms": -5}, "for_ms must be > 0"),
        ({"action": "force_open", "reason": "x", "for_ms": "10m"}, "integer"),
        ({"action": "force_open", "reason": "x", "for_ms": 1.5}, "integer"),
        ({"action": "force_open", "reason": "x", "for_ms": True}, "integer"),
        ({"action": "auto", "for_ms": 1000}, "force_open and force_closed only"),
        ({"action": "force_open", "reason": "x", "for": 60000}, "unknown key(s) for"),
    ],
)
async def test_a_bad_body_is_400_and_says_what_is_wrong(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    body: Any,
    says: str,
) -> None:
    sc = await start_sidecar(override_config(fake.url), environ=ENV)
    status_, doc = await post_override(http, sc, body)
    assert status_ == 400
    assert doc["error"]["code"] == "bad_request"
    assert says in doc["error"]["message"]
    assert "override" not in await entry(http, sc)


async def test_an_unknown_target_or_one_without_a_breaker_is_404(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(override_config(fake.url, fake2.url, model="gpt-4o"), environ=ENV)
    body = {"action": "force_open", "reason": "maintenance"}
    for path in ("nope/%2A", "primary/%2A", "primary/gpt-4", "backup/%2A"):
        status_, doc = await post_override(http, sc, body, path=path)
        assert status_ == 404, path
        assert doc["error"]["code"] == "unknown_target"
    assert (await post_override(http, sc, body, path="primary/gpt-4o"))[0] == 200


# -- force_open ---------------------------------------------------------------------------


async def test_force_open_skips_the_target_with_no_probe_until_auto(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar")
    sc = await start_sidecar(override_config(fake.url, fake2.url), environ=ENV)
    target = {"upstream": "primary", "model": "*"}
    before = await counters(http, sc)
    body = {"action": "force_open", "reason": "provider maintenance 14:00-15:00"}
    t0 = clock.now()
    status_, answer = await post_override(http, sc, body)
    assert status_ == 200
    assert (answer["upstream"], answer["model"], answer["state"]) == ("primary", "*", "open")
    assert answer["override"]["action"] == "force_open"
    # Traffic goes to the backup; the healthy primary gets nothing, not even a probe
    # after many cooldowns.
    for _ in range(3):
        r = await call(http, sc)
        assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
        clock.advance(25.0)
    assert fake.request_count == 0
    e = (await status(http, sc, all_=False))["primary/*"]
    assert (e["state"], e["retry_at"], e["probes_in_flight"]) == ("open", None, 0)
    ov = e["override"]
    assert (ov["action"], ov["reason"], ov["until"], ov["for_ms"]) == (
        "force_open",
        "provider maintenance 14:00-15:00",
        None,
        None,
    )
    assert_at(ov["set_at"], clock, t0)
    assert_at(e["opened_at"], clock, t0)
    assert await delta(http, sc, before) == {
        "force_open": 1,
        "auto": 0,
        "force_closed": 0,
        "rejections": 3,
        "fallbacks": 3,
    }
    assert await active(http, sc, "force_open") == 1
    assert await metric(http, sc, "sidecar_breaker_state", **target, state="open") == 1
    [logged] = events(caplog, "breaker_override")
    assert {k: logged[k] for k in ("upstream", "model", "action", "reason", "for_ms")} == {
        "upstream": "primary",
        "model": "*",
        "action": "force_open",
        "reason": "provider maintenance 14:00-15:00",
        "for_ms": None,
    }
    assert logged["source"] == "admin"
    assert [
        d["event"] for d in map(json.loads, lines(caplog)) if d["event"].startswith("breaker_")
    ] == [
        "breaker_override",
        "breaker_opened",
    ]

    # auto: back to its own rules, closed with its counts reset.
    status_, answer = await post_override(http, sc, {"action": "auto"})
    assert status_ == 200
    assert (answer["state"], answer["consecutive_failures"], "override" in answer) == (
        "closed",
        0,
        False,
    )
    r = await call(http, sc)
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
    assert "primary/*" not in await status(http, sc, all_=False)
    assert await active(http, sc, "force_open") == 0
    assert (await delta(http, sc, before))["auto"] == 1
    assert [d["action"] for d in events(caplog, "breaker_override")] == ["force_open", "auto"]


@pytest.fixture
def access() -> Iterator[Lines]:
    """The access log's lines while the test runs."""
    yield from capture()


async def test_force_open_of_every_candidate_answers_503_with_its_end_as_retry_after(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    access: Lines,
) -> None:
    # The target's last failure was a rate limit: a forced open still answers 503
    # circuit_open (the provider is taken out, the caller is not told to slow down).
    text = override_config(fake.url, cb=breaker_table(threshold=5), rate_limit_scope="target")
    sc = await start_sidecar(text, environ=ENV)
    assert (await call(http, sc, fault=fail(429))).status == 429
    assert (await entry(http, sc))["last_failure"] == "http_429"
    body = {"action": "force_open", "reason": "maintenance", "for_ms": 90_000}
    assert (await post_override(http, sc, body))[0] == 200
    r = await call(http, sc)
    assert (r.status, r.json()["error"]["code"], r.headers["Retry-After"]) == (
        503,
        "circuit_open",
        "90",
    )
    logged = (await access.wait(2))[-1]
    assert (logged["status"], logged["outcome"], logged["error"], logged["attempts"]) == (
        503,
        "circuit_open",
        "circuit_open",
        0,
    )
    clock.advance(30.0)
    assert (await call(http, sc)).headers["Retry-After"] == "60"
    # Without an end: the target's cooldown (10 s) as the hint.
    body = {"action": "force_open", "reason": "maintenance"}
    assert (await post_override(http, sc, body))[0] == 200
    assert (await call(http, sc)).headers["Retry-After"] == "10"
    assert fake.request_count == 1


async def test_a_call_between_retries_sends_no_more_retries_to_a_target_forced_open(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    text = configs.config(
        server={**SERVER_TABLE, "admin_token_env": TOKEN_VAR},
        upstreams={
            "primary": chain_upstream(fake.url, breaker=breaker_table(threshold=9), retries=3),
            "backup": chain_upstream(fake2.url, breaker=None),
        },
        routes=[configs.route("chat", "primary", "backup", path_prefix="/v1/")],
    )
    sc = await start_sidecar(text, environ=ENV)
    gate = asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=gate))
    task = asyncio.create_task(call(http, sc))
    async with asyncio.timeout(5):
        await fake.wait_for_requests(1)
    assert (await post_override(http, sc, {"action": "force_open", "reason": "m"}))[0] == 200
    gate.set()
    r = await task
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
    assert fake.request_count == 1  # no retry after the override
    assert (await entry(http, sc))["consecutive_failures"] == 0  # the stale result changed nothing


# -- force_closed --------------------------------------------------------------------------


async def test_force_closed_admits_a_failing_target_and_still_counts_its_failures(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(override_config(fake.url, fake2.url), environ=ENV)
    target = {"upstream": "primary", "model": "*"}
    before = await counters(http, sc)
    attempts = await metric(
        http, sc, "sidecar_upstream_attempts_total", **target, outcome="http_5xx"
    )
    opened = await metric(http, sc, "sidecar_breaker_transitions_total", **target, to="open")
    fake.set_default(Fault(status=503))
    assert (await call(http, sc)).headers["x-sidecar-upstream"] == "backup"
    assert (await entry(http, sc))["state"] == "open"  # threshold 1
    body = {"action": "force_closed", "reason": "the breaker misjudges a fine provider"}
    status_, answer = await post_override(http, sc, body)
    assert (status_, answer["state"], answer["override"]["action"]) == (
        200,
        "closed",
        "force_closed",
    )
    for _ in range(4):
        r = await call(http, sc)
        assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
    assert fake.request_count == 5  # every call tried the primary again
    e = (await status(http, sc, all_=False))["primary/*"]  # listed while overridden
    assert (e["state"], e["consecutive_failures"], e["last_failure"]) == ("closed", 5, "http_503")
    assert e["override"]["reason"] == "the breaker misjudges a fine provider"
    attempts_now = await metric(
        http, sc, "sidecar_upstream_attempts_total", **target, outcome="http_5xx"
    )
    assert attempts_now - attempts == 5
    opened_now = await metric(http, sc, "sidecar_breaker_transitions_total", **target, to="open")
    assert opened_now - opened == 1
    assert await active(http, sc, "force_closed") == 1
    assert await metric(http, sc, "sidecar_breaker_state", **target, state="closed") == 1
    assert (await delta(http, sc, before))["force_closed"] == 1

    # auto: counts reset; the breaker's own rules again (threshold 1: the next failure opens).
    status_, answer = await post_override(http, sc, {"action": "auto", "reason": "done"})
    assert (answer["state"], answer["consecutive_failures"]) == ("closed", 0)
    assert (await call(http, sc)).headers["x-sidecar-upstream"] == "backup"
    assert (await entry(http, sc))["state"] == "open"
    assert (
        await metric(http, sc, "sidecar_breaker_transitions_total", **target, to="open") - opened
        == 2
    )


async def test_force_closed_keeps_a_failure_rate_breaker_closed_too(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    cb = breaker_table(threshold=100, failure_rate_threshold=0.5, minimum_calls=2)
    sc = await start_sidecar(override_config(fake.url, fake2.url, cb=cb), environ=ENV)
    assert (await post_override(http, sc, {"action": "force_closed", "reason": "x"}))[0] == 200
    fake.set_default(Fault(status=503))
    for _ in range(4):
        await call(http, sc)
    assert fake.request_count == 4
    assert (await entry(http, sc))["state"] == "closed"


# -- expiry, targets, reload ----------------------------------------------------------------


async def test_for_ms_ends_the_override_on_the_clock(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar")
    sc = await start_sidecar(override_config(fake.url, fake2.url), environ=ENV)
    t0 = clock.now()
    body = {"action": "force_open", "reason": "maintenance", "for_ms": 600_000}
    status_, answer = await post_override(http, sc, body)
    assert (status_, answer["override"]["for_ms"]) == (200, 600_000)
    assert_at(answer["override"]["until"], clock, t0 + 600)
    clock.advance(599.9)
    assert (await call(http, sc)).headers["x-sidecar-upstream"] == "backup"
    assert (await entry(http, sc))["override"]["action"] == "force_open"
    clock.advance(0.1)  # the end: closed, with no request needed
    e = await entry(http, sc)
    assert (e["state"], "override" in e) == ("closed", False)
    assert await active(http, sc, "force_open") == 0
    [ended] = events(caplog, "breaker_override_expired")
    assert (ended["upstream"], ended["action"], ended["reason"], ended["for_ms"]) == (
        "primary",
        "force_open",
        "maintenance",
        600_000,
    )
    assert (await call(http, sc)).headers["x-sidecar-upstream"] == "primary"
    assert fake.request_count == 1


async def test_a_later_override_replaces_the_earlier_one_and_its_end(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(override_config(fake.url, fake2.url), environ=ENV)
    body = {"action": "force_open", "reason": "first", "for_ms": 10_000}
    assert (await post_override(http, sc, body))[0] == 200
    body = {"action": "force_closed", "reason": "second"}
    assert (await post_override(http, sc, body))[0] == 200
    clock.advance(20.0)  # the first one's end changes nothing now
    ov = (await entry(http, sc))["override"]
    assert (ov["action"], ov["reason"], ov["until"]) == ("force_closed", "second", None)


async def test_a_model_with_a_slash_and_a_literal_star(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(
        override_config(fake.url, fake2.url, model="meta-llama/Llama-3.1-8B"), environ=ENV
    )
    body = {"action": "force_open", "reason": "x"}
    for path in ("primary/meta-llama/Llama-3.1-8B", "primary/meta-llama%2FLlama-3.1-8B"):
        status_, answer = await post_override(http, sc, body, path=path)
        assert (status_, answer["model"]) == (200, "meta-llama/Llama-3.1-8B"), path
    sc2 = await start_sidecar(override_config(fake.url, fake2.url), environ=ENV)
    assert (await post_override(http, sc2, body, path="primary/*"))[0] == 200


async def test_an_override_survives_a_reload_that_keeps_its_target(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    tmp_path: Path,
) -> None:
    sc = await start_sidecar(override_config(fake.url, fake2.url), environ=ENV)
    body = {"action": "force_open", "reason": "maintenance", "for_ms": 60_000}
    assert (await post_override(http, sc, body))[0] == 200
    before = (await entry(http, sc))["override"]
    path = tmp_path / "sidecar.toml"
    # The breaker's settings change (its counts start again): the override stays, end included.
    path.write_text(override_config(fake.url, fake2.url, cb=breaker_table(cooldown_ms=5000)))
    assert sc.runtime is not None
    assert await reload_runtime(sc.runtime, str(path), ENV)
    assert (await entry(http, sc))["override"] == before
    assert (await call(http, sc)).headers["x-sidecar-upstream"] == "backup"
    clock.advance(60.0)
    assert "override" not in await entry(http, sc)
    assert (await call(http, sc)).headers["x-sidecar-upstream"] == "primary"
    # The token is read again: a reload that names no variable turns the endpoint off.
    path.write_text(override_config(fake.url, fake2.url, token_env=""))
    assert await reload_runtime(sc.runtime, str(path), ENV)
    assert (await post_override(http, sc, body))[0] == 404


async def test_a_reload_that_removes_the_target_drops_its_override_and_series(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    sc = await start_sidecar(override_config(fake.url, fake2.url, model="gone"), environ=ENV)
    body = {"action": "force_open", "reason": "maintenance"}
    assert (await post_override(http, sc, body, path="primary/gone"))[0] == 200
    path = tmp_path / "sidecar.toml"
    path.write_text(override_config(fake.url, fake2.url, model="kept"))
    assert sc.runtime is not None
    assert await reload_runtime(sc.runtime, str(path), ENV)
    assert "primary/gone" not in await status(http, sc)
    async with http.get(sc.admin_url + "/metrics") as r:
        text = await r.text()
    assert 'sidecar_breaker_override_active{action="force_open",model="gone"' not in text
    assert 'model="kept",upstream="primary"' in text


async def raw_admin(sc: Sidecar, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written byte for byte to the admin port (headers a client library
    would refuse to send): the answer's status and body."""
    port = int(sc.admin_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
        async with asyncio.timeout(5):
            answer = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def test_an_authorization_that_is_not_utf8_or_a_body_nested_too_deep_is_refused_not_500(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anyone can reach the admin port: an ``Authorization`` whose bytes are not UTF-8
    is a wrong token (401), never an error the handler did not expect (500 with a
    traceback at ``error`` for every such request); and a body of JSON nested deeper
    than the decoder goes is "not JSON" (400), as any other undecodable body."""
    caplog.set_level(logging.DEBUG)
    sc = await start_sidecar(override_config(fake.url), environ=ENV)
    path = b"POST /breakers/primary/%2A HTTP/1.1\r\nHost: admin\r\n"
    got = await raw_admin(sc, path + b"Authorization: Bearer \xff\xfe" + TOKEN.encode() + b"\r\n")
    assert got[0] == 401
    assert json.loads(got[1])["error"]["code"] == "unauthorized"
    auth = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
    got = await raw_admin(sc, path + auth, b"[" * 100_000 + b"]" * 100_000)
    assert got[0] == 400
    assert json.loads(got[1])["error"]["message"] == "the body must be JSON"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert len(events(caplog, "admin_unauthorized")) == 1

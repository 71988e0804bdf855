"""Issue 24, item 1: one caller's rate limit stays theirs (``rate_limit_scope``).

Through the running sidecar, with the official openai and anthropic SDKs as clients
and one fake provider that rate-limits only key A (429 to ``Bearer A`` / ``x-api-key:
A``, 200 to key B): three 429s on key A open the breaker of (target, A), so A's next
request skips the target (429 ``rate_limited``, or the fallback) while B keeps being
served by the same target; ``/status?all=1`` shows A's breaker by an 8-hex-digit hash,
and neither ``/status``, ``/metrics`` nor the logs ever hold a key. With
``rate_limit_scope = "target"`` A's 429s open the target for B too (as before).
Time moves only by ``clock.advance``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from sidecar.logs import JsonFormatter
from sidecar.reload import reload_runtime
from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests import configs
from tests.breaker_e2e_helpers import SERVER_TABLE, breaker_table, call, chain_upstream
from tests.conftest import StartSidecar, metric

KEY_A = "sk-proj-AAAA-rate-limited-7f3e9c"
KEY_B = "sk-proj-BBBB-within-limit-2d81aa"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
HI = [{"role": "user", "content": "hi"}]
RATE_LIMIT_EVENT = (
    b"event: error\n"
    b'data: {"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}\n\n'
)


def config(
    primary: str,
    backup: str | None = None,
    *,
    auth_header: str = "authorization",
    scope: str | None = None,
) -> str:
    """Route "chat": ``primary`` (breaker: 3 failures, 10 s cooldown; no retries), then
    ``backup`` when given (no breaker). No ``api_key_env``: each client's key passes."""
    keys: dict[str, Any] = {"auth_header": auth_header}
    if scope is not None:
        keys["rate_limit_scope"] = scope
    upstreams = {
        "primary": chain_upstream(primary, breaker=breaker_table(threshold=3), **keys),
    }
    if backup is not None:
        upstreams["backup"] = chain_upstream(backup, breaker=None, auth_header=auth_header)
    return configs.config(
        server=SERVER_TABLE,
        upstreams=upstreams,
        routes=[configs.route("chat", *upstreams, path_prefix="/v1/")],
    )


async def breakers(http: aiohttp.ClientSession, sc: Sidecar, all_: bool = True) -> list[Any]:
    async with http.get(sc.admin_url + "/status" + ("?all=1" if all_ else "")) as r:
        assert r.status == 200
        text = await r.text()
    assert KEY_A not in text and KEY_B not in text
    doc: dict[str, list[Any]] = json.loads(text)
    return doc["breakers"]


async def scrape(http: aiohttp.ClientSession, sc: Sidecar) -> str:
    async with http.get(sc.admin_url + "/metrics") as r:
        return await r.text()


def no_key_anywhere(text: str) -> None:
    for key in (KEY_A, KEY_B):
        for part in (key, key[8:], key[-6:]):  # nor any telling piece of it
            assert part not in text


def oai(sc: Sidecar, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key=key, max_retries=0)


def ant(sc: Sidecar, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=sc.proxy_url, api_key=key, max_retries=0)


class Sdk:
    """One official SDK's client per key, and one call of it."""

    def __init__(self, name: str, sc: Sidecar) -> None:
        self.name = name
        if name == "openai":
            self.a: Any = oai(sc, KEY_A)
            self.b: Any = oai(sc, KEY_B)
        else:
            self.a, self.b = ant(sc, KEY_A), ant(sc, KEY_B)

    async def call(self, client: Any) -> Any:
        """One call; the raw response (its status and headers), whatever the status."""
        try:
            if self.name == "openai":
                return await client.chat.completions.with_raw_response.create(
                    model="gpt-4o", messages=HI
                )
            return await client.messages.with_raw_response.create(
                model="claude-sonnet-4-5", max_tokens=8, messages=HI
            )
        except (openai.APIStatusError, anthropic.APIStatusError) as err:
            return err.response

    async def __aenter__(self) -> Sdk:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in (self.a, self.b):
            await client.close()


SDKS = [("openai", "authorization"), ("anthropic", "x-api-key")]


@pytest.mark.parametrize(("sdk_name", "auth_header"), SDKS)
async def test_one_keys_rate_limit_opens_its_own_breaker_only(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    sdk_name: str,
    auth_header: str,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar")
    fake.fault_for_key(KEY_A)  # the provider: key A is over its limit, B is not
    sc = await start_sidecar(config(fake.url, auth_header=auth_header))
    async with Sdk(sdk_name, sc) as sdk:
        await one_key_limited(sdk, sc, fake, http, clock, caplog, auth_header)


async def one_key_limited(
    sdk: Sdk,
    sc: Sidecar,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    auth_header: str,
) -> None:
    transitions = "sidecar_breaker_transitions_total"
    rejections = "sidecar_breaker_rejections_total"
    target = {"upstream": "primary", "model": "*"}
    opened = await metric(http, sc, transitions, **target, to="open")  # (process-wide)
    rejected = await metric(http, sc, rejections, **target)
    for n in (1, 2, 3):  # three 429s on A, relayed as they came
        r = await sdk.call(sdk.a)
        assert (r.status_code, r.headers.get("x-sidecar-upstream")) == (429, "primary")
        assert fake.request_count == 2 * n - 1
        assert (await sdk.call(sdk.b)).status_code == 200  # B in between: never touched
    sent = fake.request_count
    assert sent == 6
    r = await sdk.call(sdk.a)  # A's breaker is open: A skips the target, nothing sent
    assert r.status_code == 429
    assert r.headers["x-sidecar-error"] == "rate_limited"
    assert r.headers["Retry-After"] == "10"
    assert r.headers["x-should-retry"] == "false"
    assert fake.request_count == sent
    for _ in range(3):  # B keeps being served by the same target
        r = await sdk.call(sdk.b)
        assert (r.status_code, r.headers["x-sidecar-upstream"]) == (200, "primary")
    assert fake.request_count == sent + 3
    # Both SDKs send the key as "Authorization: Bearer" (the anthropic SDK 2.x too,
    # where x-api-key is configured): the credential is read there when the configured
    # auth_header is absent.
    sent_keys = [req.headers.get("authorization") for req in fake.requests[-3:]]
    assert sent_keys == [f"Bearer {KEY_B}"] * 3

    # /status: the target is closed (nothing listed without ?all=1); ?all=1 lists A's
    # breaker by the first 8 hex digits of its keyed hash, never the key.
    assert await breakers(http, sc, all_=False) == []
    listed = await breakers(http, sc)
    targets = [b for b in listed if "credential" not in b]
    mine = [b for b in listed if "credential" in b]
    assert [(b["upstream"], b["state"]) for b in targets] == [("primary", "closed")]
    assert len(mine) == 1
    a = mine[0]
    assert re.fullmatch(r"[0-9a-f]{8}", a["credential"])
    assert (a["upstream"], a["model"], a["state"]) == ("primary", "*", "open")
    assert (a["consecutive_failures"], a["last_failure"]) == (3, "http_429")

    # Metrics: the target's breaker never moved; no credential anywhere.
    text = await scrape(http, sc)
    no_key_anywhere(text)
    assert a["credential"] not in text
    state = "sidecar_breaker_state"
    assert await metric(http, sc, state, **target, state="closed") == 1
    assert await metric(http, sc, transitions, **target, to="open") == opened
    assert await metric(http, sc, rejections, **target) == rejected

    # The cooldown ends; A's limit is lifted: A's next call is its breaker's probe,
    # which closes it (and /status?all=1 forgets it).
    fake.fault_for_key(KEY_A, None)
    clock.advance(10.0)
    r = await sdk.call(sdk.a)
    assert (r.status_code, r.headers["x-sidecar-upstream"]) == (200, "primary")
    assert [b for b in await breakers(http, sc) if "credential" in b] == []

    # Logs: A's breaker opened, went half-open and closed, named by its short hash;
    # no line holds a key.
    lines = [JsonFormatter().format(r) for r in caplog.records if r.name == "sidecar"]
    for line in lines:
        no_key_anywhere(line)
    moves = [json.loads(x) for x in lines if '"event":"breaker_' in x.replace(" ", "")]
    assert [(d["event"], d.get("credential")) for d in moves] == [
        ("breaker_opened", a["credential"]),
        ("breaker_half_open", a["credential"]),
        ("breaker_closed", a["credential"]),
    ]
    assert (moves[0]["upstream"], moves[0]["last_failure"]) == ("primary", "http_429")


async def test_a_rate_limited_key_falls_back_while_others_stay(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    fake.fault_for_key(KEY_A)
    sc = await start_sidecar(config(fake.url, fake2.url))
    async with Sdk("openai", sc) as sdk:
        await falls_back(sdk, sc, fake, fake2, http)


async def falls_back(
    sdk: Sdk, sc: Sidecar, fake: FakeUpstream, fake2: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    for _ in range(3):  # each 429 moves on to the backup (a failing status falls back)
        r = await sdk.call(sdk.a)
        assert (r.status_code, r.headers["x-sidecar-upstream"]) == (200, "backup")
    assert (fake.request_count, fake2.request_count) == (3, 3)
    fallbacks = "sidecar_fallbacks_total"
    skipped = await metric(
        http, sc, fallbacks, route="chat", upstream="primary", reason="circuit_open"
    )
    r = await sdk.call(sdk.a)  # A's breaker is open: straight to the backup
    assert (r.status_code, r.headers["x-sidecar-upstream"]) == (200, "backup")
    assert r.headers["x-sidecar-attempts"] == "1"
    assert (fake.request_count, fake2.request_count) == (3, 4)
    after = await metric(
        http, sc, fallbacks, route="chat", upstream="primary", reason="circuit_open"
    )
    assert after == skipped + 1
    r = await sdk.call(sdk.b)  # B: the primary, as ever
    assert (r.status_code, r.headers["x-sidecar-upstream"]) == (200, "primary")


async def test_a_rate_limit_error_event_counts_against_the_key(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """A streamed 200 whose first event is Anthropic's ``rate_limit_error`` is a rate
    limit like a 429: it counts against the key, not the target."""
    event = Fault(content_type="text/event-stream", body=RATE_LIMIT_EVENT)
    fake.fault_for_key(KEY_A, event)
    sc = await start_sidecar(config(fake.url, auth_header="x-api-key"))
    headers = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
    body = {"model": "m", "max_tokens": 8, "messages": HI, "stream": True}
    for _ in range(3):
        r = await call(http, sc, MESSAGES, body=body, headers=headers)
        assert r.status == 200 and r.body == RATE_LIMIT_EVENT  # the only answer: relayed
    r = await call(http, sc, MESSAGES, body=body, headers=headers)
    assert (r.status, r.headers["x-sidecar-error"]) == (429, "rate_limited")
    assert fake.request_count == 3
    r = await call(http, sc, MESSAGES, body=body, headers={**headers, "x-api-key": KEY_B})
    assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
    (entry,) = [b for b in await breakers(http, sc) if "credential" in b]
    assert (entry["state"], entry["last_failure"]) == ("open", "sse_error")


async def test_other_failures_still_open_the_target_for_everyone(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(config(fake.url))
    fake.fault_for_key(KEY_A, Fault(status=503))  # not a rate limit: the target's
    async with Sdk("openai", sc) as sdk:
        for _ in range(3):
            assert (await sdk.call(sdk.a)).status_code == 503
        r = await sdk.call(sdk.b)
    assert (r.status_code, r.headers["x-sidecar-error"]) == (503, "circuit_open")
    assert [b["state"] for b in await breakers(http, sc, all_=False)] == ["open"]


@pytest.mark.parametrize(("sdk_name", "auth_header"), SDKS)
async def test_scope_target_keeps_the_old_behaviour(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    sdk_name: str,
    auth_header: str,
) -> None:
    fake.fault_for_key(KEY_A)
    sc = await start_sidecar(config(fake.url, auth_header=auth_header, scope="target"))
    async with Sdk(sdk_name, sc) as sdk:
        for _ in range(3):
            assert (await sdk.call(sdk.a)).status_code == 429
        r = await sdk.call(sdk.b)  # A's 429s opened the target: B is skipped too
    assert (r.status_code, r.headers["x-sidecar-error"]) == (429, "rate_limited")
    assert fake.request_count == 3
    listed = await breakers(http, sc)
    assert [(b["state"], "credential" in b) for b in listed] == [("open", False)]


def test_effective_scope_follows_api_key_env() -> None:
    """The default: ``credential`` without ``api_key_env``, ``target`` with it."""
    from sidecar.config import parse_config

    keys: Mapping[str, Any] = {"api_key_env": "K"}
    with_key = configs.config(
        upstreams={"p": configs.upstream("http://127.0.0.1:1", **keys)},
        routes=[configs.route("r", "p")],
    )
    without = configs.config(
        upstreams={"p": configs.upstream("http://127.0.0.1:1")}, routes=[configs.route("r", "p")]
    )
    assert parse_config(with_key, {"K": "x"}).upstreams["p"].rate_limit_scope == "target"
    assert parse_config(without, {}).upstreams["p"].rate_limit_scope == "credential"


@pytest.mark.parametrize(("change", "kept"), [("drain", True), ("auth_header", False)])
async def test_a_reload_keeps_the_credential_breakers_of_kept_targets(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    change: str,
    kept: bool,
) -> None:
    """Contract, "Reload": a breaker whose target and settings are unchanged is kept as
    it is; so are its credentials' breakers (same credential header). A changed
    ``auth_header`` names other credentials: they start afresh."""
    fake.fault_for_key(KEY_A)
    text = config(fake.url)
    sc = await start_sidecar(text)
    for _ in range(3):
        assert (await call(http, sc, headers={"authorization": f"Bearer {KEY_A}"})).status == 429
    path = tmp_path / "sidecar.toml"
    if change == "drain":
        path.write_text(text.replace("drain_timeout_ms = 200", "drain_timeout_ms = 300"))
    else:
        path.write_text(config(fake.url, auth_header="x-api-key"))
    assert sc.runtime is not None
    assert await reload_runtime(sc.runtime, str(path), {})
    r = await call(http, sc, headers={"authorization": f"Bearer {KEY_A}"})
    if kept:
        assert (r.status, r.headers["x-sidecar-error"], fake.request_count) == (
            429,
            "rate_limited",
            3,
        )
    else:
        assert (r.status, r.headers["x-sidecar-upstream"], fake.request_count) == (
            429,
            "primary",
            4,
        )
    assert len([b for b in await breakers(http, sc) if "credential" in b]) == (1 if kept else 0)

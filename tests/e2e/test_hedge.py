"""Hedged first token (route ``hedge_after_ms``), through the running sidecar.

Contract, "Bounding the load that failures add": a candidate with no commit point
``hedge_after_ms`` after it was sent is raced by the next candidate (never one whose
breaker refuses it, within the retry budget, once per request); the first to reach
its commit point is relayed, the other cancelled (connection closed, outcome
``cancelled``, neutral for its breaker); a racer that fails leaves the other alone;
``sidecar_hedges_total{route, result}`` counts ``won``, ``lost`` and ``not_sent``.

Time is the FakeClock's: the hedge timer fires when a test advances it past
``hedge_after_ms`` (1 s here); answers are held with :class:`asyncio.Event` gates, so
which racer reaches its commit point first is the test's choice, with no sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import aiohttp
import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.access_log_helpers import Lines, capture
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar, metric, status

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
AFTER_S = 1.0
JSON_ANSWER = (
    b'{"id":"chatcmpl-backup","object":"chat.completion","model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"from the hedge"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}'
)
SSE_ANSWER = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":"one"}}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":" two"}}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)
NO_RETRY = {"max_retries": 0}
BREAKER = {"failure_threshold": 1, "cooldown_ms": 600000}


def hedged(
    primary_url: str,
    backup_url: str,
    *,
    after_ms: int = 1000,
    primary: Mapping[str, Any] | None = None,
    backup: Mapping[str, Any] | None = None,
    server: Mapping[str, Any] | None = None,
) -> str:
    """``primary`` then ``backup`` (no retries, a breaker that opens on one failure)
    under route ``chat`` with ``hedge_after_ms``, and route ``direct`` (``/direct/``)
    over ``backup`` alone (to open its breaker from outside the race)."""
    p = {"retry": NO_RETRY, "circuit_breaker": BREAKER, **(primary or {})}
    b = {"retry": NO_RETRY, "circuit_breaker": BREAKER, **(backup or {})}
    return config(
        server=server,
        upstreams={"primary": upstream(primary_url, **p), "backup": upstream(backup_url, **b)},
        routes=[
            route("chat", "primary", "backup", path_prefix="/v1/", hedge_after_ms=after_ms),
            route("direct", "backup", path_prefix="/direct/"),
        ],
    )


HEDGES = {r: ("sidecar_hedges_total", {"route": "chat", "result": r}) for r in ("won", "lost")}
SERIES: dict[str, tuple[str, dict[str, str]]] = {
    **HEDGES,
    "not_sent": ("sidecar_hedges_total", {"route": "chat", "result": "not_sent"}),
    "primary_cancelled": (
        "sidecar_upstream_attempts_total",
        {"upstream": "primary", "model": "*", "outcome": "cancelled"},
    ),
    "backup_cancelled": (
        "sidecar_upstream_attempts_total",
        {"upstream": "backup", "model": "*", "outcome": "cancelled"},
    ),
    "primary_success": (
        "sidecar_upstream_attempts_total",
        {"upstream": "primary", "model": "*", "outcome": "success"},
    ),
    "backup_success": (
        "sidecar_upstream_attempts_total",
        {"upstream": "backup", "model": "*", "outcome": "success"},
    ),
    "fallback_failure": (
        "sidecar_fallbacks_total",
        {"route": "chat", "upstream": "primary", "reason": "failure"},
    ),
    "unrelayed_tokens": (
        "sidecar_tokens_total",
        {"route": "chat", "upstream": "backup", "kind": "input", "relayed": "false"},
    ),
}
"""The series these tests read (the registry is the process's: each test reads changes)."""


async def counts(http: aiohttp.ClientSession, sc: Sidecar) -> dict[str, float]:
    return {k: await metric(http, sc, name, **labels) for k, (name, labels) in SERIES.items()}


async def moved(
    http: aiohttp.ClientSession, sc: Sidecar, before: dict[str, float]
) -> dict[str, float]:
    after = await counts(http, sc)
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


class Answer:
    """What the client got: status, the sidecar's headers, the body's bytes."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        self.upstream = headers.get("x-sidecar-upstream")
        self.attempts = headers.get("x-sidecar-attempts")
        self.body = body


async def post(http: aiohttp.ClientSession, sc: Sidecar, path: str = CHAT, **extra: Any) -> Answer:
    async with http.post(sc.proxy_url + path, json={**BODY, **extra}) as r:
        return Answer(r.status, r.headers, await r.read())


async def closed(fake: FakeUpstream) -> None:
    """Until every connection the fake accepted is closed (the sidecar let go of it)."""
    async with asyncio.timeout(5):
        await fake.wait_until(lambda: fake.open_connections == 0 and fake.active_requests == 0)


async def hedge_sent(clock: FakeClock, fake: FakeUpstream, fake2: FakeUpstream) -> None:
    """Once the primary holds the request, pass ``hedge_after_ms``; then the backup
    holds its copy."""
    async with asyncio.timeout(5):
        await fake.wait_for_requests(1)
    clock.advance(AFTER_S)
    async with asyncio.timeout(5):
        await fake2.wait_for_requests(1)


@pytest.fixture
def log() -> Iterator[Lines]:
    yield from capture()


@pytest.fixture
async def fake3() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(name="third") as f:
        yield f


@pytest.fixture
async def sc_pair(
    fake: FakeUpstream, fake2: FakeUpstream, start_sidecar: StartSidecar
) -> AsyncIterator[Sidecar]:
    yield await start_sidecar(hedged(fake.url, fake2.url))


# -- the faster wins ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "answer"),
    [("application/json", JSON_ANSWER), ("text/event-stream", SSE_ANSWER)],
    ids=["json", "sse"],
)
async def test_the_hedge_answers_first_and_is_relayed_byte_identical(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
    content_type: str,
    answer: bytes,
) -> None:
    sc = sc_pair
    before = await counts(http, sc)
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))  # headers, then nothing
    fake2.set_default(Fault(body=answer, content_type=content_type, chunks=3))
    call = asyncio.ensure_future(post(http, sc, stream=content_type == "text/event-stream"))
    await hedge_sent(clock, fake, fake2)
    async with asyncio.timeout(5):
        got = await call

    assert (got.status, got.upstream, got.attempts) == (200, "backup", "2")
    assert got.body == answer
    await closed(fake)  # the loser's connection was closed, not kept for reuse
    change = await moved(http, sc, before)
    assert change == {"won": 1, "primary_cancelled": 1, "backup_success": 1}
    breakers = await status(http, sc)
    assert breakers["primary/*"]["state"] == "closed"  # cancelled: neutral
    assert breakers["primary/*"]["consecutive_failures"] == 0
    (line,) = await log.wait(1)
    assert (line["upstream"], line["attempts"], line["fallbacks"]) == ("backup", 2, 0)
    assert line["hedge"] == "won"
    assert line["outcome"] == "ok"


async def test_the_primary_answers_first_the_hedge_is_cancelled(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    sc = sc_pair
    before = await counts(http, sc)
    primary_go = asyncio.Event()
    fake.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=primary_go))
    fake2.set_default(Fault(hold_first_chunk=asyncio.Event()))  # never answers
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call

    assert (got.status, got.upstream, got.attempts, got.body) == (200, "primary", "2", JSON_ANSWER)
    await closed(fake2)
    assert await moved(http, sc, before) == {
        "lost": 1,
        "backup_cancelled": 1,
        "primary_success": 1,
    }
    assert (await status(http, sc))["backup/*"]["consecutive_failures"] == 0
    (line,) = await log.wait(1)
    assert (line["upstream"], line["attempts"], line["hedge"]) == ("primary", 2, "lost")


async def test_an_answer_before_hedge_after_ms_sends_no_hedge(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    sc = sc_pair
    before = await counts(http, sc)
    got = await post(http, sc)
    clock.advance(10 * AFTER_S)  # its timer was disarmed with the answer
    assert (got.status, got.upstream, got.attempts) == (200, "primary", "1")
    assert fake.request_count == 1
    assert fake2.request_count == 0
    assert await moved(http, sc, before) == {"primary_success": 1}
    (line,) = await log.wait(1)
    assert line["hedge"] is None  # a hedging route's line says no hedge was due


# -- a failing racer leaves the other alone ---------------------------------------------------


async def test_a_hedge_that_fails_fast_leaves_the_primary_alone(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = sc_pair
    before = await counts(http, sc)
    primary_go = asyncio.Event()
    fake.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=primary_go))
    fake2.set_default(Fault(status=503))
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    async with asyncio.timeout(5):
        await fake2.wait_until(lambda: fake2.active_requests == 0)  # the 503 was sent
    assert not call.done()  # the primary goes on alone
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts, got.body) == (200, "primary", "2", JSON_ANSWER)
    assert await moved(http, sc, before) == {"lost": 1, "primary_success": 1}
    assert (await status(http, sc))["backup/*"]["state"] == "open"  # a real failure counts


async def test_a_primary_that_fails_leaves_the_hedge_alone(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    sc = sc_pair
    before = await counts(http, sc)
    primary_go, hedge_go = asyncio.Event(), asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=primary_go))
    fake2.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=hedge_go))
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    primary_go.set()
    async with asyncio.timeout(5):
        await fake.wait_until(lambda: fake.active_requests == 0)
    assert not call.done()  # the hedge goes on alone
    hedge_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts, got.body) == (200, "backup", "2", JSON_ANSWER)
    assert fake2.request_count == 1  # not called again by the fallback loop
    assert await moved(http, sc, before) == {
        "won": 1,
        "fallback_failure": 1,
        "backup_success": 1,
    }
    (line,) = await log.wait(1)
    assert (line["attempts"], line["fallbacks"], line["upstream_error"]) == (2, 1, "http_503")
    assert line["hedge"] == "won"


async def test_both_fail_the_last_failure_is_relayed(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = sc_pair
    before = await counts(http, sc)
    primary_go = asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=primary_go))
    fake2.set_default(Fault(status=502))
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call
    # In the route's order the hedged candidate comes last: its answer is relayed.
    assert (got.status, got.upstream, got.attempts) == (502, "backup", "2")
    assert await moved(http, sc, before) == {"lost": 1, "fallback_failure": 1}


# -- no hedge ---------------------------------------------------------------------------------


async def test_no_hedge_past_the_budget(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    no_budget = {"retry": {"max_retries": 0, "budget_percent": 0, "min_retry_concurrency": 0}}
    sc = await start_sidecar(hedged(fake.url, fake2.url, backup=no_budget))
    before = await counts(http, sc)
    primary_go = asyncio.Event()
    fake.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=primary_go))
    call = asyncio.ensure_future(post(http, sc))
    async with asyncio.timeout(5):
        await fake.wait_for_requests(1)
    clock.advance(AFTER_S)
    assert await moved(http, sc, before) == {"not_sent": 1}
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts) == (200, "primary", "1")
    assert fake2.request_count == 0
    (line,) = await log.wait(1)
    assert line["hedge"] == "not_sent"


async def test_the_budget_not_sent_candidate_is_still_the_fallback(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """A hedge not sent for want of budget leaves its candidate to the fallback loop."""
    no_budget = {"retry": {"max_retries": 0, "budget_percent": 0, "min_retry_concurrency": 0}}
    sc = await start_sidecar(hedged(fake.url, fake2.url, backup=no_budget))
    primary_go = asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=primary_go))
    call = asyncio.ensure_future(post(http, sc))
    async with asyncio.timeout(5):
        await fake.wait_for_requests(1)
    clock.advance(AFTER_S)
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts) == (200, "backup", "2")
    assert fake2.request_count == 1


async def test_no_hedge_to_a_candidate_whose_breaker_is_open(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = sc_pair
    fake2.set_default(Fault(status=503))
    assert (await post(http, sc, "/direct/chat/completions")).status == 503
    assert (await status(http, sc))["backup/*"]["state"] == "open"
    fake2.set_default(Fault())
    before = await counts(http, sc)
    primary_go = asyncio.Event()
    fake.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=primary_go))
    call = asyncio.ensure_future(post(http, sc))
    async with asyncio.timeout(5):
        await fake.wait_for_requests(1)
    clock.advance(AFTER_S)
    assert await moved(http, sc, before) == {"not_sent": 1}
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts) == (200, "primary", "1")
    assert fake2.request_count == 1  # the /direct/ call only


async def test_a_route_without_hedge_after_ms_never_hedges(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    sc = await start_sidecar(hedged(fake.url, fake2.url, after_ms=0))
    primary_go = asyncio.Event()
    fake.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=primary_go))
    call = asyncio.ensure_future(post(http, sc))
    async with asyncio.timeout(5):
        await fake.wait_for_requests(1)
    clock.advance(30.0)
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts) == (200, "primary", "1")
    assert fake2.request_count == 0
    (line,) = await log.wait(1)
    assert "hedge" not in line  # only a hedging route's lines carry the field


# -- the client and the deadline end both ------------------------------------------------------


async def test_a_client_that_leaves_during_the_race_closes_both_connections(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    sc = sc_pair
    before = await counts(http, sc)
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
    fake2.set_default(Fault(hold_first_chunk=asyncio.Event()))
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    call.cancel()  # the client goes away
    with pytest.raises(asyncio.CancelledError):
        await call
    await closed(fake)
    await closed(fake2)
    (line,) = await log.wait(1)
    assert (line["status"], line["attempts"], line["hedge"]) == (499, 2, "lost")
    assert await moved(http, sc, before) == {
        "lost": 1,
        "primary_cancelled": 1,
        "backup_cancelled": 1,
    }


async def test_the_request_deadline_cuts_both_racers(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(hedged(fake.url, fake2.url, server={"request_timeout_ms": 5000}))
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
    fake2.set_default(Fault(hold_first_chunk=asyncio.Event()))
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    clock.advance(5.0 - AFTER_S)
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.attempts) == (504, "2")
    await closed(fake)
    await closed(fake2)


async def test_one_hedge_per_request(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    fake3: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """Three candidates: after the primary fails the hedge runs alone; the third is
    not raced in as a second hedge, and is called only when the hedge fails too."""
    keys = {"retry": NO_RETRY}
    sc = await start_sidecar(
        config(
            upstreams={
                "primary": upstream(fake.url, **keys),
                "backup": upstream(fake2.url, **keys),
                "third": upstream(fake3.url, **keys),
            },
            routes=[
                route("chat", "primary", "backup", "third", path_prefix="/v1/", hedge_after_ms=1000)
            ],
        )
    )
    primary_go, hedge_go = asyncio.Event(), asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=primary_go))
    fake2.set_default(Fault(status=503, hold_headers=hedge_go))
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    primary_go.set()
    async with asyncio.timeout(5):
        await fake.wait_until(lambda: fake.active_requests == 0)
    clock.advance(10 * AFTER_S)
    assert fake3.request_count == 0
    hedge_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts) == (200, "third", "3")


async def test_candidates_a_breaker_refuses_are_passed_over_and_counted_once(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    fake3: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    """Three candidates, the second's breaker open: the hedge goes to the third; when
    the primary then fails, the second is a ``circuit_open`` fallback (not asked again)
    and the running hedge is relayed."""
    keys = {"retry": NO_RETRY, "circuit_breaker": BREAKER}
    sc = await start_sidecar(
        config(
            upstreams={
                "primary": upstream(fake.url, **keys),
                "backup": upstream(fake2.url, **keys),
                "third": upstream(fake3.url, **keys),
            },
            routes=[
                route(
                    "chat", "primary", "backup", "third", path_prefix="/v1/", hedge_after_ms=1000
                ),
                route("direct", "backup", path_prefix="/direct/"),
            ],
        )
    )
    fake2.set_default(Fault(status=503))
    assert (await post(http, sc, "/direct/chat/completions")).status == 503
    rejected = {"upstream": "backup", "model": "*"}
    rejections = await metric(http, sc, "sidecar_breaker_rejections_total", **rejected)
    primary_go = asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=primary_go))
    hedge_go = asyncio.Event()
    fake3.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=hedge_go))
    fallbacks = {
        why: ("sidecar_fallbacks_total", {"route": "chat", "upstream": up, "reason": why})
        for up, why in (("primary", "failure"), ("backup", "circuit_open"))
    }
    before = {k: await metric(http, sc, n, **labels) for k, (n, labels) in fallbacks.items()}
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake3)
    primary_go.set()
    async with asyncio.timeout(5):
        await fake.wait_until(lambda: fake.active_requests == 0)
    assert not call.done()
    hedge_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts, got.body) == (200, "third", "2", JSON_ANSWER)
    assert fake2.request_count == 1  # the /direct/ call only
    after = await metric(http, sc, "sidecar_breaker_rejections_total", **rejected)
    assert after - rejections == 1  # asked once, by the hedge's search
    for k, (n, labels) in fallbacks.items():
        assert await metric(http, sc, n, **labels) - before[k] == 1, k
    _, line = await log.wait(2)
    assert (line["route"], line["fallbacks"], line["hedge"]) == ("chat", 2, "won")


async def test_a_hedge_that_failed_with_usage_counts_its_tokens_as_not_relayed(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = sc_pair
    before = await counts(http, sc)
    primary_go = asyncio.Event()
    fake.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=primary_go))
    fake2.set_default(Fault(shape="openai_empty_json"))  # an empty turn: a failure
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    async with asyncio.timeout(5):
        await fake2.wait_until(lambda: fake2.active_requests == 0)
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.body) == (200, "primary", JSON_ANSWER)
    change = await moved(http, sc, before)
    assert change == {"lost": 1, "primary_success": 1, "unrelayed_tokens": 140}


async def test_a_half_open_probe_is_not_hedged(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    sc_pair: Sidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """A probe's answer is what its breaker waits for: it runs alone to its end."""
    sc = sc_pair
    fake.set_default(Fault(status=503))
    got = await post(http, sc)  # the primary fails at once (no hedge due) and opens
    assert (got.status, got.upstream) == (200, "backup")
    assert (await status(http, sc))["primary/*"]["state"] == "open"
    clock.advance(600.0)  # cooldown_ms: the next call to the primary is its probe
    before = await counts(http, sc)
    primary_go = asyncio.Event()
    fake.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=primary_go))
    call = asyncio.ensure_future(post(http, sc))
    async with asyncio.timeout(5):
        await fake.wait_for_requests(2)
    clock.advance(10 * AFTER_S)
    assert fake2.request_count == 1
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts) == (200, "primary", "1")
    assert await moved(http, sc, before) == {"primary_success": 1}
    assert (await status(http, sc))["primary/*"]["state"] == "closed"


async def test_a_tier_member_is_hedged_by_another_member(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    keys = {"retry": NO_RETRY}
    sc = await start_sidecar(
        config(
            upstreams={"a": upstream(fake.url, **keys), "b": upstream(fake2.url, **keys)},
            routes=[
                route(
                    "chat",
                    {"upstream": "a", "tier": 0},
                    {"upstream": "b", "tier": 0},
                    path_prefix="/v1/",
                    balance="ordered",
                    hedge_after_ms=1000,
                )
            ],
        )
    )
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
    fake2.set_default(Fault(body=JSON_ANSWER))
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts, got.body) == (200, "b", "2", JSON_ANSWER)
    await closed(fake)


async def test_each_racer_keeps_its_own_first_byte_timeout(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    """The hedge's first-byte deadline is its own (its child Exchange's timer): at 1 s
    the hedge is sent, at 3 s it times out and the primary goes on; at 5 s the
    primary's own first-byte deadline has not passed, and its answer is relayed."""
    sc = await start_sidecar(
        hedged(
            fake.url,
            fake2.url,
            primary={"first_byte_timeout_ms": 10000},
            backup={"first_byte_timeout_ms": 2000},
        )
    )
    before = await counts(http, sc)
    primary_go = asyncio.Event()
    fake.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=primary_go))
    fake2.set_default(Fault(hold_first_chunk=asyncio.Event()))
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    clock.advance(2.0)  # the hedge's first-byte deadline
    await closed(fake2)
    clock.advance(2.0)
    assert not call.done()
    primary_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts, got.body) == (200, "primary", "2", JSON_ANSWER)
    assert await moved(http, sc, before) == {"lost": 1, "primary_success": 1}
    (line,) = await log.wait(1)
    assert (line["upstream_error"], line["hedge"]) == ("timeout", "lost")


async def test_a_primary_timing_out_leaves_the_hedge_alone(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(hedged(fake.url, fake2.url, primary={"first_byte_timeout_ms": 3000}))
    hedge_go = asyncio.Event()
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
    fake2.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=hedge_go))
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake2)
    clock.advance(2.0)  # the primary's first-byte deadline
    await closed(fake)
    assert not call.done()
    hedge_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts, got.body) == (200, "backup", "2", JSON_ANSWER)


def three_with_backup_half_open(
    fake: FakeUpstream, fake2: FakeUpstream, fake3: FakeUpstream
) -> str:
    keys = {"retry": NO_RETRY, "circuit_breaker": BREAKER}
    return config(
        upstreams={
            "primary": upstream(fake.url, **keys),
            "backup": upstream(fake2.url, **keys),
            "third": upstream(fake3.url, **keys),
        },
        routes=[
            route("chat", "primary", "backup", "third", path_prefix="/v1/", hedge_after_ms=1000),
            route("direct", "backup", path_prefix="/direct/"),
        ],
    )


async def half_open_backup(
    http: aiohttp.ClientSession, sc: Sidecar, fake2: FakeUpstream, clock: FakeClock
) -> None:
    """Open the backup's breaker from outside the race, then let its cooldown pass: its
    next call is a probe."""
    fake2.set_default(Fault(status=503))
    assert (await post(http, sc, "/direct/chat/completions")).status == 503
    clock.advance(600.0)
    assert (await status(http, sc))["backup/*"]["state"] == "half_open"


async def test_after_the_primary_fails_the_hedge_goes_on_alone_before_a_passed_over_probe(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    fake3: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    """Three candidates, the second half-open: the hedge passes over it (a probe is
    never hedged to) and goes to the third. The primary then fails: the hedge goes on
    alone (contract: "if one fails before its commit point, the other goes on alone"),
    and its answer is relayed when it comes; the second is not sent a probe beside it
    (on main it was, and the hedge's committed answer waited for that probe)."""
    sc = await start_sidecar(three_with_backup_half_open(fake, fake2, fake3))
    await half_open_backup(http, sc, fake2, clock)
    fake2.set_default(Fault(hold_first_chunk=asyncio.Event()))  # a probe would never answer
    primary_go, hedge_go = asyncio.Event(), asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=primary_go))
    fake3.set_default(Fault(body=JSON_ANSWER, hold_first_chunk=hedge_go))
    before = await counts(http, sc)
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake3)
    primary_go.set()
    async with asyncio.timeout(5):
        await fake.wait_until(lambda: fake.active_requests == 0)
    hedge_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.attempts, got.body) == (200, "third", "2", JSON_ANSWER)
    assert fake2.request_count == 1  # the /direct/ call only: no probe beside the hedge
    assert (await moved(http, sc, before))["won"] == 1
    assert (await status(http, sc))["backup/*"]["state"] == "half_open"
    _, line = await log.wait(2)
    assert (line["upstream"], line["attempts"], line["hedge"]) == ("third", 2, "won")


async def test_a_probe_passed_over_by_the_hedge_is_sent_once_the_hedge_has_failed(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    fake3: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    """As above, but the hedge fails too: the loop then asks the second candidate's
    breaker again and sends it its probe, which answers and closes the breaker; no
    task, connection or attempt of the race is left when the handler ends."""
    sc = await start_sidecar(three_with_backup_half_open(fake, fake2, fake3))
    await half_open_backup(http, sc, fake2, clock)
    fake2.set_default(Fault(body=JSON_ANSWER))
    primary_go, hedge_go = asyncio.Event(), asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=primary_go))
    fake3.set_default(Fault(status=503, hold_headers=hedge_go))
    before = await counts(http, sc)
    call = asyncio.ensure_future(post(http, sc))
    await hedge_sent(clock, fake, fake3)
    primary_go.set()
    async with asyncio.timeout(5):
        await fake.wait_until(lambda: fake.active_requests == 0)
    assert fake2.request_count == 1  # no probe while the hedge runs
    hedge_go.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.body) == (200, "backup", JSON_ANSWER)
    assert got.attempts == "3"  # the primary, the hedge, the probe
    assert fake3.active_requests == 0
    assert (await moved(http, sc, before))["lost"] == 1
    assert (await status(http, sc))["backup/*"]["state"] == "closed"
    _, line = await log.wait(2)
    assert (line["upstream"], line["attempts"], line["hedge"]) == ("backup", 3, "lost")


async def test_a_hedge_that_wins_over_a_primary_queued_for_a_connection_keeps_its_idle_timeout(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    log: Lines,
) -> None:
    """The primary's only pooled connection is busy (``max_connections = 1``), so the
    primary waits for it; at ``hedge_after_ms`` the hedge goes to the backup, streams
    its first event (the commit point: the primary's wait is cut, nothing sent) and
    stalls. The relayed stream is cut by the backup's ``idle_timeout_ms`` as any
    stream is: the primary's cut wait for a connection leaves no pause behind on the
    request's deadlines (on main the stream hung: the idle deadline was ignored)."""
    sc = await start_sidecar(
        config(
            upstreams={
                "primary": upstream(fake.url, retry=NO_RETRY, max_connections=1),
                "backup": upstream(fake2.url, retry=NO_RETRY, idle_timeout_ms=5000),
            },
            routes=[
                route("chat", "primary", "backup", path_prefix="/v1/", hedge_after_ms=1000),
                route("hold", "primary", path_prefix="/hold/"),
            ],
        )
    )
    holder_go = asyncio.Event()
    fake.set_default(Fault(hold_first_chunk=holder_go))
    holder = asyncio.ensure_future(post(http, sc, "/hold/chat/completions"))
    async with asyncio.timeout(5):
        await fake.wait_for_requests(1)
    fake2.set_default(Fault(hold_after_chunks=(2, asyncio.Event())))  # then nothing
    call = asyncio.ensure_future(http.post(sc.proxy_url + CHAT, json={**BODY, "stream": True}))
    assert sc.runtime is not None
    pool = sc.runtime.current.upstreams["primary"].pool
    assert pool is not None
    for _ in range(10_000):
        if pool.waiting:
            break
        await asyncio.sleep(0)
    else:
        raise AssertionError("never queued")
    clock.advance(AFTER_S)  # the hedge goes to the backup and commits
    async with asyncio.timeout(5):
        r = await call
    try:
        assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "backup")
        assert r.headers["x-sidecar-attempts"] == "1"  # the primary was never sent
        async with asyncio.timeout(5):
            assert (await r.content.readany()).startswith(b"data: ")
        clock.advance(5.0)  # the backup's idle_timeout_ms
        async with asyncio.timeout(5):
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
    finally:
        r.release()
    holder_go.set()
    async with asyncio.timeout(5):
        assert (await holder).status == 200
    await closed(fake2)
    line = next(x for x in await log.wait(2) if x["route"] == "chat")
    assert (line["hedge"], line["outcome"], line["attempts"]) == ("won", "aborted", 1)


async def test_a_json_answer_cut_mid_body_leaves_no_first_output_time_to_the_next_call(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """The primary's JSON answer sends its first chunk at once (read under the idle
    deadline from then) and breaks 0.5 s later: the fallback to the backup answers at
    once. The backup's time to first output is 0 s, not the primary's first chunk less
    the backup's send time (-0.5 s, a negative observation in
    ``sidecar_upstream_first_byte_seconds`` and a time the chooser would take as the
    fastest ever)."""
    # No hedge (the rule is _call's, on every route): the request's one timer is then
    # re-armed at the primary's idle deadline once its first chunk is read, which is
    # what the test waits for (with a hedge due, the timer stays armed at the hedge).
    sc = await start_sidecar(
        hedged(fake.url, fake2.url, after_ms=0, primary={"idle_timeout_ms": 7000})
    )
    name = "sidecar_upstream_first_byte_seconds"
    backup = {"upstream": "backup", "model": "*"}
    before = {s: await metric(http, sc, f"{name}_{s}", **backup) for s in ("sum", "count")}
    cut = asyncio.Event()
    fake.set_default(
        Fault(body=JSON_ANSWER, chunks=2, hold_after_chunks=(1, cut), reset_after_chunks=1)
    )
    fake2.set_default(Fault(body=JSON_ANSWER))
    call = asyncio.ensure_future(post(http, sc))
    idle_at = clock.now() + 7.0  # the primary's first chunk was read: its idle deadline
    for _ in range(100_000):
        if idle_at in clock.pending():
            break
        await asyncio.sleep(0)
    else:
        raise AssertionError("the primary's first chunk was never read")
    clock.advance(0.5)
    cut.set()
    async with asyncio.timeout(5):
        got = await call
    assert (got.status, got.upstream, got.body) == (200, "backup", JSON_ANSWER)
    after = {s: await metric(http, sc, f"{name}_{s}", **backup) for s in ("sum", "count")}
    assert (after["count"] - before["count"], after["sum"] - before["sum"]) == (1, 0.0)

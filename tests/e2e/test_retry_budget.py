"""The retry budget, full jitter and a client's own retries, through the running sidecar.

Contract, "Bounding the load that failures add": a retry on an upstream starts only
while its retries in flight are fewer than ``max(min_retry_concurrency, budget_percent
% of its requests in flight)``, else the request falls back (``sidecar_fallbacks_total``
reason ``budget``, ``sidecar_retries_skipped_total`` reason ``budget``); each backoff
wait is drawn from [0, the backoff] (``retry.jitter``); a request that is an SDK's
retry (``x-stainless-retry-count`` >= 1) gets no retry of the sidecar's own.

Concurrency without wall-clock waits: the primary's answers are held with
:class:`asyncio.Event` gates, so every request is in flight at once when the failures
come, and the retries that were granted stay in flight while the others decide.
"""

from __future__ import annotations

import asyncio
from random import Random

import aiohttp
import openai
import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.configs import fallback, single
from tests.conftest import StartSidecar, metric

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def budget_pair(a: str, b: str, **retry: object) -> str:
    """``primary`` (2 retries, 1 ms backoff, no breaker: every failure is retried or
    skipped, nothing is benched) then ``backup``."""
    keys = {"max_retries": 2, "backoff_initial_ms": 1, "backoff_max_ms": 1, **retry}
    return fallback(a, b, primary={"retry": keys})


PRIMARY = {"upstream": "primary", "model": "*"}
SERIES: dict[str, tuple[str, dict[str, str]]] = {
    "budget": ("sidecar_retries_skipped_total", {**PRIMARY, "reason": "budget"}),
    "client_retry": ("sidecar_retries_skipped_total", {**PRIMARY, "reason": "client_retry"}),
    "retries": ("sidecar_retries_total", PRIMARY),
    "fallback_budget": (
        "sidecar_fallbacks_total",
        {"route": "chat", "upstream": "primary", "reason": "budget"},
    ),
    "fallback_failure": (
        "sidecar_fallbacks_total",
        {"route": "chat", "upstream": "primary", "reason": "failure"},
    ),
}
"""The series these tests read (metrics are the process's: each test reads its change)."""


async def counts(http: aiohttp.ClientSession, sc: Sidecar) -> dict[str, float]:
    return {k: await metric(http, sc, name, **labels) for k, (name, labels) in SERIES.items()}


async def moved(
    http: aiohttp.ClientSession, sc: Sidecar, before: dict[str, float]
) -> dict[str, float]:
    """The series that changed since ``before``, by how much."""
    after = await counts(http, sc)
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


async def post(http: aiohttp.ClientSession, url: str) -> tuple[int, str, str]:
    async with http.post(url + CHAT, json=BODY) as r:
        await r.read()
        return r.status, r.headers["x-sidecar-upstream"], r.headers["x-sidecar-attempts"]


@pytest.mark.parametrize(
    ("retry", "granted"),
    [
        ({}, 3),  # the defaults: 20 % of 10 = 2 < min_retry_concurrency 3
        ({"budget_percent": 50, "min_retry_concurrency": 1}, 5),  # 50 % of 10
    ],
)
async def test_retries_past_the_budget_fall_back_and_are_counted(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    retry: dict[str, object],
    granted: int,
) -> None:
    n = 10
    sc = await start_sidecar(budget_pair(fake.url, fake2.url, **retry))
    before = await counts(http, sc)
    failing, retried = asyncio.Event(), asyncio.Event()
    fake.set_default(Fault(status=503, hold_headers=failing))
    calls = [asyncio.ensure_future(post(http, sc.proxy_url)) for _ in range(n)]
    async with asyncio.timeout(10):
        await fake.wait_for_requests(n)  # every request in flight on the primary
    fake.set_default(Fault(hold_headers=retried))  # a retry would pass, once let go
    failing.set()  # ten 503s at once: each call wants a retry
    skipped = n - granted
    async with asyncio.timeout(10):
        await fake2.wait_for_requests(skipped)  # those past the budget fell back at once
        await fake.wait_for_requests(n + granted)  # the granted retries, held
    assert fake.request_count == n + granted
    retried.set()
    async with asyncio.timeout(10):
        answers = await asyncio.gather(*calls)

    assert sorted(answers) == sorted(
        [(200, "primary", "2")] * granted + [(200, "backup", "2")] * skipped
    )
    assert fake2.request_count == skipped
    assert await moved(http, sc, before) == {
        "budget": skipped,
        "fallback_budget": skipped,
        "retries": granted,
    }


async def test_the_budget_is_given_back_when_the_retries_end(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """After a wave, the next failing request is retried again (nothing leaks)."""
    sc = await start_sidecar(
        budget_pair(fake.url, fake2.url, budget_percent=0, min_retry_concurrency=1)
    )
    before = await counts(http, sc)
    fake.script([Fault(status=503), Fault(status=503), Fault()] * 3)
    for _ in range(3):  # one at a time: each gets its retries (one in flight at a time)
        assert await post(http, sc.proxy_url) == (200, "primary", "3")
    assert fake2.request_count == 0
    assert await moved(http, sc, before) == {"retries": 6}


async def test_no_budget_no_retry_the_last_candidate_relays_its_failure(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """``budget_percent = 0`` and ``min_retry_concurrency = 0``: no retry ever; with no
    candidate left the failing answer is relayed as it came (contract, "Fallback")."""
    sc = await start_sidecar(
        single(fake.url, retry={"max_retries": 2, "budget_percent": 0, "min_retry_concurrency": 0})
    )
    before = await counts(http, sc)
    fake.set_default(Fault(status=503))
    async with http.post(sc.proxy_url + CHAT, json=BODY) as r:
        assert r.status == 503
        assert r.headers["x-sidecar-attempts"] == "1"
        assert "x-should-retry" not in r.headers  # no retry, no fallback: the client may
    assert fake.request_count == 1
    assert await moved(http, sc, before) == {"budget": 1}  # no candidate left: no fallback


# -- full jitter ------------------------------------------------------------------------


def jitter_config(url: str, **retry: object) -> str:
    return single(url, retry={"max_retries": 2, **retry})  # backoff 250 ms, 500 ms


async def test_backoff_waits_are_the_seeded_draws(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """With jitter (the default), each wait is the backoff times the next draw of the
    sidecar's seeded random source: not the 250 ms, 500 ms of the schedule itself."""
    sc = await start_sidecar(jitter_config(fake.url), rand=Random(7))
    fake.script([Fault(status=503), Fault(status=502), Fault()])
    async with http.post(sc.proxy_url + CHAT, json=BODY) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-attempts"] == "3"
    draws = Random(7)
    expected = [0.25 * draws.random(), 0.5 * draws.random()]
    assert clock.sleeps == expected
    assert clock.sleeps != [0.25, 0.5]


async def test_jitter_off_waits_the_schedule(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(jitter_config(fake.url, jitter=False), rand=Random(7))
    fake.script([Fault(status=503), Fault(status=502), Fault()])
    async with http.post(sc.proxy_url + CHAT, json=BODY) as r:
        assert r.status == 200
    assert clock.sleeps == [0.25, 0.5]


async def test_a_retry_after_is_waited_as_it_came(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(jitter_config(fake.url), rand=Random(7))
    fake.script([Fault(status=429, retry_after="2"), Fault(status=503), Fault()])
    async with http.post(sc.proxy_url + CHAT, json=BODY) as r:
        assert r.status == 200
    assert clock.sleeps == [2.0, 0.5 * Random(7).random()]  # the draw only for the backoff


# -- a client's own retry ----------------------------------------------------------------


@pytest.mark.parametrize(("count", "primary_attempts"), [("1", 1), ("2", 1), ("0", 3), (None, 3)])
async def test_a_client_retry_gets_no_sidecar_retry_but_still_falls_back(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    count: str | None,
    primary_attempts: int,
) -> None:
    sc = await start_sidecar(budget_pair(fake.url, fake2.url))
    before = await counts(http, sc)
    fake.set_default(Fault(status=503))
    headers = {} if count is None else {"X-Stainless-Retry-Count": count}
    async with http.post(sc.proxy_url + CHAT, json=BODY, headers=headers) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "backup"
        assert r.headers["x-sidecar-attempts"] == str(primary_attempts + 1)
    assert fake.request_count == primary_attempts
    assert fake2.request_count == 1
    for q in (*fake.requests, *fake2.requests):  # relayed as received
        assert q.headers.get("x-stainless-retry-count") == count
    if primary_attempts == 1:  # a client's retry: the retry was due, and skipped
        assert await moved(http, sc, before) == {"client_retry": 1, "fallback_failure": 1}
    else:
        assert await moved(http, sc, before) == {"retries": 2, "fallback_failure": 1}


async def test_the_openai_sdk_retry_is_not_multiplied_by_the_sidecar(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
) -> None:
    """The official SDK retries a 503 relayed without ``x-should-retry`` (here
    ``client_retry_hint = false``); its retry says ``x-stainless-retry-count: 1``, and
    the sidecar then makes no retries of its own: 3 + 1 upstream attempts, not 3 + 3."""
    sc = await start_sidecar(
        single(
            fake.url,
            server={"client_retry_hint": False},
            retry={"max_retries": 2, "backoff_initial_ms": 1},
        )
    )
    fake.set_default(Fault(status=503))
    c = openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key="k", max_retries=1)
    try:
        with pytest.raises(openai.InternalServerError) as raised:
            await c.chat.completions.create(model="m", messages=BODY["messages"])  # type: ignore[arg-type]
    finally:
        await c.close()
    assert raised.value.status_code == 503
    assert [q.headers["x-stainless-retry-count"] for q in fake.requests] == ["0", "0", "0", "1"]

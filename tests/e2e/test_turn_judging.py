"""Whole turns judged at the commit point, through the running sidecar.

Contract (/work/shared/design/interface.md), "The proxy port": "Streamed answers"
(reasoning is output; error events before output), "An empty turn is a failure",
"Context-window overflow"; "The circuit breaker" (a failure is counted once per
candidate call; an empty probe is neutral); "Metrics" (attempt outcomes ``sse_error``
and ``empty_turn``, fallback reasons ``failure``, ``empty_turn``, ``context_window``,
``sidecar_stream_aborts_total`` reasons).

The fake upstreams answer with the byte-exact turns of
:mod:`sidecar.testing.turn_shapes`; the bytes a client must get are rendered again
from the fake's own record of each request. Time moves only by ``clock.advance``
(the FakeClock drives every deadline of the sidecar); holds are Event gates.
Metrics are compared as deltas (the registry is process-global).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.access_log_helpers import Lines, capture
from tests.breaker_e2e_helpers import breaker_table, entry
from tests.conftest import StartSidecar
from tests.turn_helpers import (
    ABORTS,
    ATTEMPTS,
    CHAT,
    FALLBACKS,
    MESSAGES,
    RETRIES,
    WAIT_S,
    chain_config,
    chunks_sent,
    delta_since,
    doc_of,
    healthy,
    path_of,
    post,
    scrape,
    sent_by,
)

THINKING_STREAMS = {
    "openai_reasoning_stream": 2,  # role chunk (reasoning_content ""), first reasoning_content
    "openrouter_reasoning_stream": 1,  # its first chunk is a reasoning delta
    "anthropic_thinking_stream": 4,  # message_start, content_block_start, ping, thinking_delta
    "responses_reasoning_stream": 5,  # created, in_progress, item added, part added, delta
}
"""Per reasoning stream: the number of events up to and including its first thinking delta."""

EMPTY_TURNS = [
    "openai_empty_stream",
    "anthropic_empty_stream",
    "responses_empty_stream",
    "openai_empty_json",
    "anthropic_empty_json",
    "responses_empty_json",
]
LENGTH_CUTS = [
    "openai_length_empty_stream",
    "anthropic_max_tokens_empty_stream",
    "responses_incomplete_empty_stream",
    "openai_length_empty_json",
    "anthropic_max_tokens_empty_json",
    "responses_incomplete_empty_json",
]
THINK_KEYS: dict[str, Any] = {"first_byte_timeout_ms": 2000, "idle_timeout_ms": 120_000}
PRIMARY = {"upstream": "primary"}


@pytest.fixture
def access() -> Iterator[Lines]:
    yield from capture()


# -- 1. a long think commits at its first thinking event ---------------------------------


@pytest.mark.parametrize(("shape", "k"), THINKING_STREAMS.items())
async def test_a_90_s_think_commits_at_the_first_thinking_delta_and_never_times_out(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    access: Lines,
    shape: str,
    k: int,
) -> None:
    """Contract, "Streamed answers": **reasoning is output**; its first thinking event
    commits, and a long think is then bounded by ``idle_timeout_ms``, never by
    ``first_byte_timeout_ms`` (2 s here): the client has status, headers and the held
    bytes with the first thinking delta before the upstream goes on; 90 s pass on the
    fake clock; the rest arrives and the client has every byte the fake sent; one
    attempt, a success, no fallback, the breaker (threshold 1) closed with 0 failures."""
    sc = await start_sidecar(
        chain_config(fake.url, fake2.url, retries=2, cb=breaker_table(threshold=1), **THINK_KEYS)
    )
    gate = asyncio.Event()
    fake.set_default(Fault(shape=shape, hold_after_chunks=(k, gate)))
    fake2.set_default(Fault(shape=healthy(shape)))
    before = await scrape(http, sc)
    try:
        async with (
            asyncio.timeout(WAIT_S),
            http.post(sc.proxy_url + path_of(shape), json=doc_of(shape)) as r,
        ):
            assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
            committed = b"".join(chunks_sent(fake)[:k])
            assert await r.content.readexactly(len(committed)) == committed
            assert not gate.is_set() and fake.active_requests == 1  # the fake still holds
            clock.advance(90.0)
            gate.set()
            body = committed + await r.read()
    finally:
        gate.set()
    assert body == sent_by(fake)  # byte-identical, the whole turn
    d = await delta_since(http, sc, before)
    assert (fake.request_count, fake2.request_count) == (1, 0)
    assert d(ATTEMPTS, **PRIMARY, outcome="success") == 1
    assert d(ATTEMPTS, **PRIMARY) == 1  # no timeout, no other attempt
    assert d(FALLBACKS, route="chat") == 0
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)
    (line,) = await access.wait(1)
    assert (line["status"], line["outcome"], line["attempts"], line["fallbacks"]) == (
        200,
        "ok",
        1,
        0,
    )
    assert line["first_byte_ms"] == 0.0  # committed before the 90 s went by
    assert line["duration_ms"] == pytest.approx(90_000.0)


# -- 2. contrast: held events alone do time out -------------------------------------------

HELD_ONLY = [
    ("openai_empty_stream", 1),  # the role-only chunk
    *((shape, k - 1) for shape, k in THINKING_STREAMS.items()),  # all but the first delta
]


@pytest.mark.parametrize(("shape", "held"), HELD_ONLY)
async def test_held_events_alone_hit_the_first_byte_timeout(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    shape: str,
    held: int,
) -> None:
    """Contract, "Streamed answers" and "The commit point": events that carry no output
    (the role-only chunk, ``message_start``, ``content_block_start``, ``ping``,
    ``response.created``/``in_progress``/``output_item.added``/
    ``reasoning_summary_part.added``) are held, so ``first_byte_timeout_ms`` still runs:
    2.1 s later the attempt is a timeout and the next candidate answers (the test above
    can fail)."""
    sc = await start_sidecar(
        chain_config(fake.url, fake2.url, retries=2, cb=breaker_table(threshold=1), **THINK_KEYS)
    )
    gate = asyncio.Event()
    fake.set_default(Fault(shape=shape, hold_after_chunks=(held, gate)))
    fake2.set_default(Fault(shape=healthy(shape)))
    before = await scrape(http, sc)
    try:
        task = asyncio.ensure_future(post(http, sc, path_of(shape), doc_of(shape)))
        async with asyncio.timeout(WAIT_S):
            await fake.wait_for_requests(1)
        assert not task.done()
        clock.advance(2.1)
        a = await task
    finally:
        gate.set()
    assert (a.status, a.upstream, a.headers["x-sidecar-attempts"]) == (200, "backup", "2")
    assert a.body == sent_by(fake2)  # none of the held bytes
    assert (fake.request_count, fake2.request_count) == (1, 1)  # a timeout is not retried
    d = await delta_since(http, sc, before)
    assert d(ATTEMPTS, **PRIMARY, outcome="timeout") == 1
    assert d(FALLBACKS, route="chat", **PRIMARY, reason="failure") == 1
    e = await entry(http, sc)
    assert (e["state"], e["last_failure"]) == ("open", "timeout")


# -- 3. response.failed / error event before output ---------------------------------------


@pytest.mark.parametrize("shape", ["responses_failed_stream", "responses_error_event_stream"])
async def test_responses_failure_before_output_falls_back_and_counts_once(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    shape: str,
) -> None:
    """Contract, "Streamed answers": the Responses API's ``response.failed`` (error at
    ``response.error``) and its ``error`` event before any output end the attempt
    before the commit point as a failure like a 5xx (outcome ``sse_error``): retried
    (1 + max_retries attempts), then the next candidate, whose answer alone the client
    gets. "The circuit breaker": counted once per candidate call, not per attempt."""
    sc = await start_sidecar(chain_config(fake.url, fake2.url, retries=2))
    fake.set_default(Fault(shape=shape))
    fake2.set_default(Fault(shape="responses_cached_stream"))
    before = await scrape(http, sc)
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.upstream, a.headers["x-sidecar-attempts"]) == (200, "backup", "4")
    assert a.body == sent_by(fake2)
    assert b"server_error" not in a.body
    assert (fake.request_count, fake2.request_count) == (3, 1)
    d = await delta_since(http, sc, before)
    assert d(ATTEMPTS, **PRIMARY, outcome="sse_error") == 3
    assert d(ATTEMPTS, **PRIMARY) == 3
    assert d(RETRIES, **PRIMARY) == 2
    assert d(FALLBACKS, route="chat", **PRIMARY, reason="failure") == 1
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"], e["last_failure"]) == (
        "closed",
        1,
        "sse_error",
    )
    (line,) = await access.wait(1)
    assert (line["upstream"], line["attempts"], line["fallbacks"], line["outcome"]) == (
        "backup",
        4,
        1,
        "ok",
    )
    assert line["upstream_error"] == "sse_error"  # the last failed attempt's cause


async def test_responses_failed_with_threshold_1_opens_after_one_call(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """Contract, "The circuit breaker": the failed call (three ``response.failed``
    attempts) is one failure: a threshold of 1 opens the breaker with
    ``consecutive_failures`` 1; the next request skips the primary."""
    cb = breaker_table(threshold=1)
    sc = await start_sidecar(chain_config(fake.url, fake2.url, retries=2, cb=cb))
    fake.set_default(Fault(shape="responses_failed_stream"))
    fake2.set_default(Fault(shape="responses_cached_stream"))
    shape = "responses_failed_stream"
    assert (await post(http, sc, path_of(shape), doc_of(shape))).upstream == "backup"
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"], e["last_failure"]) == (
        "open",
        1,
        "sse_error",
    )
    assert (await post(http, sc, path_of(shape), doc_of(shape))).upstream == "backup"
    assert fake.request_count == 3


# -- 4. an empty turn is retried once, then one failure and the next candidate ----------


@pytest.mark.parametrize("retries", [2, 5, 0])
@pytest.mark.parametrize("shape", EMPTY_TURNS)
async def test_an_empty_turn_is_retried_once_then_falls_back_and_counts_one_failure(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    shape: str,
    retries: int,
) -> None:
    """Contract, "An empty turn is a failure": a turn that ends cleanly with no output
    (streamed or JSON) is retried once on the same candidate, never more whatever
    ``max_retries`` says and not at all when it is 0; then it is one failure for the
    breaker (``last_failure`` ``empty_turn``) and the request moves on (fallback reason
    ``empty_turn``); each empty attempt has outcome ``empty_turn``."""
    sc = await start_sidecar(chain_config(fake.url, fake2.url, retries=retries))
    fake.set_default(Fault(shape=shape))
    fake2.set_default(Fault(shape=healthy(shape)))
    n = 2 if retries else 1
    before = await scrape(http, sc)
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.upstream, a.headers["x-sidecar-attempts"]) == (200, "backup", str(n + 1))
    assert a.body == sent_by(fake2)
    assert (fake.request_count, fake2.request_count) == (n, 1)
    d = await delta_since(http, sc, before)
    assert d(ATTEMPTS, **PRIMARY, outcome="empty_turn") == n
    assert d(ATTEMPTS, **PRIMARY) == n
    assert d(RETRIES, **PRIMARY) == n - 1
    assert d(FALLBACKS, route="chat", **PRIMARY, reason="empty_turn") == 1
    assert d(FALLBACKS, route="chat") == 1
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"], e["last_failure"]) == (
        "closed",
        1,
        "empty_turn",
    )
    (line,) = await access.wait(1)
    assert (line["upstream"], line["attempts"], line["fallbacks"], line["outcome"]) == (
        "backup",
        n + 1,
        1,
        "ok",
    )
    assert line["upstream_error"] == "empty_turn"


@pytest.mark.parametrize("shape", EMPTY_TURNS)
async def test_an_empty_turn_whose_retry_answers_is_a_success_on_the_same_candidate(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    shape: str,
) -> None:
    """Contract, "An empty turn is a failure": the one retry on the same candidate
    that answers with output is relayed (no fallback), and the candidate call is a
    success: the count of an earlier failure is reset."""
    sc = await start_sidecar(chain_config(fake.url, fake2.url, retries=2))
    fake.script([Fault(status=501), Fault(shape=shape), Fault(shape=healthy(shape))])
    fake2.set_default(Fault(shape=healthy(shape)))
    assert (await post(http, sc, path_of(shape), doc_of(shape))).upstream == "backup"
    before = await scrape(http, sc)
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.upstream, a.headers["x-sidecar-attempts"]) == (200, "primary", "2")
    assert a.body == sent_by(fake)
    assert (fake.request_count, fake2.request_count) == (3, 1)
    d = await delta_since(http, sc, before)
    assert d(ATTEMPTS, **PRIMARY, outcome="empty_turn") == 1
    assert d(ATTEMPTS, **PRIMARY, outcome="success") == 1
    assert d(FALLBACKS, route="chat") == 0
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)


@pytest.mark.parametrize("shape", EMPTY_TURNS)
async def test_the_last_candidates_empty_turn_is_relayed_as_it_came(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    shape: str,
) -> None:
    """Contract, "An empty turn is a failure": the last candidate's empty answer (after
    its one retry) is relayed as it came: status 200, the bytes of its last attempt."""
    sc = await start_sidecar(chain_config(fake.url, retries=2))
    fake.set_default(Fault(shape=shape))
    before = await scrape(http, sc)
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.upstream, a.headers["x-sidecar-attempts"]) == (200, "primary", "2")
    assert fake.request_count == 2
    assert a.body == sent_by(fake, -1)
    assert "x-should-retry" not in a.headers  # a 200 is not a failing status
    d = await delta_since(http, sc, before)
    assert d(ATTEMPTS, **PRIMARY, outcome="empty_turn") == 2
    assert d(FALLBACKS, route="chat") == 0
    e = await entry(http, sc)
    assert (e["consecutive_failures"], e["last_failure"]) == (1, "empty_turn")


@pytest.mark.parametrize("shape", EMPTY_TURNS)
async def test_empty_turn_is_failure_false_relays_it_at_once_as_a_success(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    shape: str,
) -> None:
    """Contract, "Configuration" (``empty_turn_is_failure``) and "An empty turn is a
    failure": with it false, an empty turn is an answer like any other: relayed at once
    (one request, no retry, no fallback), outcome ``success``, the count reset."""
    sc = await start_sidecar(
        chain_config(fake.url, fake2.url, retries=2, empty_turn_is_failure=False)
    )
    fake.script([Fault(status=501), Fault(shape=shape)])
    fake2.set_default(Fault(shape=healthy(shape)))
    assert (await post(http, sc, path_of(shape), doc_of(shape))).upstream == "backup"
    assert (await entry(http, sc))["consecutive_failures"] == 1
    before = await scrape(http, sc)
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.upstream, a.headers["x-sidecar-attempts"]) == (200, "primary", "1")
    assert a.body == sent_by(fake)
    assert (fake.request_count, fake2.request_count) == (2, 1)
    d = await delta_since(http, sc, before)
    assert d(ATTEMPTS, **PRIMARY, outcome="success") == 1
    assert d(ATTEMPTS, **PRIMARY) == 1
    assert (await entry(http, sc))["consecutive_failures"] == 0


# -- 5. an empty turn cut by the length limit is a success --------------------------------


@pytest.mark.parametrize("shape", LENGTH_CUTS)
async def test_an_empty_turn_after_a_length_cut_is_relayed_and_a_success(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    shape: str,
) -> None:
    """Contract, "An empty turn is a failure": a length cut is not empty
    (``finish_reason`` ``length``, ``stop_reason`` ``max_tokens``,
    ``incomplete_details.reason`` ``max_output_tokens``): one request, relayed byte for
    byte, outcome ``success``, and it resets the count of an earlier failure."""
    sc = await start_sidecar(chain_config(fake.url, fake2.url, retries=2))
    fake.script([Fault(status=501), Fault(shape=shape)])  # 501: counted, never retried
    fake2.set_default(Fault(shape=healthy(shape)))
    assert (await post(http, sc, path_of(shape), doc_of(shape))).upstream == "backup"
    assert (await entry(http, sc))["consecutive_failures"] == 1
    before = await scrape(http, sc)
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.upstream, a.headers["x-sidecar-attempts"]) == (200, "primary", "1")
    assert a.body == sent_by(fake)
    assert (fake.request_count, fake2.request_count) == (2, 1)
    d = await delta_since(http, sc, before)
    assert d(ATTEMPTS, **PRIMARY, outcome="success") == 1
    assert d(ATTEMPTS, **PRIMARY) == 1
    assert d(FALLBACKS, route="chat") == 0
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)


# -- 6. an empty probe is neutral ---------------------------------------------------------


@pytest.mark.parametrize("shape", EMPTY_TURNS)
async def test_an_empty_probe_leaves_the_breaker_half_open_and_frees_its_slot(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    shape: str,
) -> None:
    """Contract, "An empty turn is a failure" and "The circuit breaker": a half-open
    probe that gets an empty turn is neutral: no retry (a probe is one request), it
    frees the probe slot, the breaker stays half_open, and the request moves on to the
    next candidate; the next request is admitted as a probe again and closes it."""
    cb = breaker_table(threshold=1, cooldown_ms=1000)
    sc = await start_sidecar(chain_config(fake.url, fake2.url, retries=2, cb=cb))
    fake.script([Fault(status=501), Fault(shape=shape), Fault(shape=healthy(shape))])
    fake2.set_default(Fault(shape=healthy(shape)))
    path, doc = path_of(shape), doc_of(shape)
    assert (await post(http, sc, path, doc)).upstream == "backup"
    assert (await entry(http, sc))["state"] == "open"
    clock.advance(1.0)
    assert (await entry(http, sc))["state"] == "half_open"
    before = await scrape(http, sc)
    a = await post(http, sc, path, doc)  # the probe
    assert (a.status, a.upstream, a.headers["x-sidecar-attempts"]) == (200, "backup", "2")
    assert a.body == sent_by(fake2)
    assert (fake.request_count, fake2.request_count) == (2, 2)  # the probe was not retried
    e = await entry(http, sc)
    assert (e["state"], e["probes_in_flight"], e["consecutive_failures"]) == ("half_open", 0, 1)
    assert e["last_failure"] == "http_501"
    d = await delta_since(http, sc, before)
    assert d(ATTEMPTS, **PRIMARY, outcome="empty_turn") == 1
    assert d(FALLBACKS, route="chat", **PRIMARY, reason="empty_turn") == 1
    a = await post(http, sc, path, doc)  # admitted as a probe again: the slot is free
    assert (a.status, a.upstream) == (200, "primary")
    assert a.body == sent_by(fake)
    assert fake.request_count == 3
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)


# -- 7. context window, and cuts after the commit point ----------------------------------


@pytest.mark.parametrize(
    ("shape", "path"), [("openai_context_window", CHAT), ("anthropic_context_window", MESSAGES)]
)
async def test_a_context_window_400_falls_back_with_reason_context_window(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    shape: str,
    path: str,
) -> None:
    """Contract, "Context-window overflow" and "Metrics": the 400 moves on to the next
    candidate, never retried, neutral for the breaker, counted in
    ``sidecar_fallbacks_total{reason="context_window"}``."""
    sc = await start_sidecar(
        chain_config(fake.url, fake2.url, retries=2, cb=breaker_table(threshold=1))
    )
    fake.set_default(Fault(shape=shape))
    backup_shape = "openai_cached_json" if path == CHAT else "anthropic_cached_json"
    fake2.set_default(Fault(shape=backup_shape))
    before = await scrape(http, sc)
    a = await post(http, sc, path, doc_of(backup_shape))
    assert (a.status, a.upstream, a.headers["x-sidecar-attempts"]) == (200, "backup", "2")
    assert a.body == sent_by(fake2)
    assert (fake.request_count, fake2.request_count) == (1, 1)
    d = await delta_since(http, sc, before)
    assert d(FALLBACKS, route="chat", **PRIMARY, reason="context_window") == 1
    assert d(FALLBACKS, route="chat") == 1
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)


FIRST_CONTENT = {
    "openai_cached_stream": 2,  # role chunk, first content delta
    "anthropic_cached_stream": 4,  # message_start, content_block_start, ping, text_delta
    "responses_cached_stream": 5,  # created, in_progress, item added, part added, delta
}
"""Per stream: the number of events up to and including its first output event."""


@pytest.mark.parametrize(("shape", "k"), FIRST_CONTENT.items())
async def test_a_cut_after_the_commit_point_counts_upstream_cut(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    shape: str,
    k: int,
) -> None:
    """Contract, "The commit point" and "Metrics": a reset after the first output event
    aborts the client connection (a payload error, never a clean end), with no retry and
    no fallback; ``sidecar_stream_aborts_total{reason="upstream_cut"}`` counts it, and the
    attempt is the success it was at its commit point."""
    sc = await start_sidecar(chain_config(fake.url, fake2.url, retries=2))
    fake.set_default(Fault(shape=shape, reset_after_chunks=k))
    before = await scrape(http, sc)
    received = b""
    async with (
        asyncio.timeout(WAIT_S),
        http.post(sc.proxy_url + path_of(shape), json=doc_of(shape)) as r,
    ):
        assert (r.status, r.headers["x-sidecar-upstream"]) == (200, "primary")
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in r.content.iter_any():
                received += chunk
    assert received == b"".join(chunks_sent(fake)[:k])
    assert (fake.request_count, fake2.request_count) == (1, 0)
    d = await delta_since(http, sc, before)
    assert d(ABORTS, **PRIMARY, reason="upstream_cut") == 1
    assert d(ABORTS, **PRIMARY) == 1
    assert d(ATTEMPTS, **PRIMARY, outcome="success") == 1
    (line,) = await access.wait(1)
    assert (line["status"], line["outcome"]) == (200, "aborted")


async def test_an_idle_timeout_after_the_commit_point_counts_idle_timeout(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    access: Lines,
) -> None:
    """Contract, "The commit point" and "Metrics": after the commit, an idle gap longer
    than ``idle_timeout_ms`` aborts the client connection, counted in
    ``sidecar_stream_aborts_total{reason="idle_timeout"}``."""
    shape = "openai_cached_stream"
    sc = await start_sidecar(chain_config(fake.url, retries=2, idle_timeout_ms=1000))
    gate = asyncio.Event()
    fake.set_default(Fault(shape=shape, hold_after_chunks=(2, gate)))
    before = await scrape(http, sc)
    try:
        async with (
            asyncio.timeout(WAIT_S),
            http.post(sc.proxy_url + CHAT, json=doc_of(shape)) as r,
        ):
            assert r.status == 200
            committed = b"".join(chunks_sent(fake)[:2])
            assert await r.content.readexactly(len(committed)) == committed
            rest = asyncio.ensure_future(r.read())
            # The idle deadline is armed right after the committed write: advance past
            # it (on the fake clock) until the relay gives up; bounded loop turns.
            for _ in range(200):
                if rest.done():
                    break
                clock.advance(1.001)
                await asyncio.sleep(0)
            with pytest.raises(aiohttp.ClientPayloadError):
                await rest
    finally:
        gate.set()
    d = await delta_since(http, sc, before)
    assert d(ABORTS, **PRIMARY, reason="idle_timeout") == 1
    assert d(ABORTS, **PRIMARY) == 1
    assert fake.request_count == 1
    (line,) = await access.wait(1)
    assert (line["status"], line["outcome"]) == (200, "aborted")


async def test_a_client_that_leaves_mid_stream_counts_client_left(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
) -> None:
    """Contract, "Metrics": a client that goes away after the commit point is counted in
    ``sidecar_stream_aborts_total{reason="client_left"}``; "Logs": status 499, outcome
    ``client_closed``; the breaker is not touched (a neutral cut after a success)."""
    shape = "openai_cached_stream"
    sc = await start_sidecar(chain_config(fake.url, retries=2))
    gate = asyncio.Event()
    fake.set_default(Fault(shape=shape, hold_after_chunks=(2, gate)))
    before = await scrape(http, sc)
    try:
        async with (
            aiohttp.ClientSession() as leaving,
            asyncio.timeout(WAIT_S),
            leaving.post(sc.proxy_url + CHAT, json=doc_of(shape)) as r,
        ):
            assert r.status == 200
            committed = b"".join(chunks_sent(fake)[:2])
            assert await r.content.readexactly(len(committed)) == committed
            r.close()  # the client leaves mid-stream
        (line,) = await access.wait(1)
    finally:
        gate.set()
    assert (line["status"], line["outcome"]) == (499, "client_closed")
    d = await delta_since(http, sc, before)
    assert d(ABORTS, **PRIMARY, reason="client_left") == 1
    assert d(ABORTS, **PRIMARY) == 1
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)

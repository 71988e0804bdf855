"""Token metering through the running sidecar: ``sidecar_tokens_total`` and the access log.

Contract (/work/shared/design/interface.md), "The proxy port", "Tokens are metered":
usage as the provider reports it, never estimated (OpenAI-style ``prompt_tokens`` less
``cached_tokens`` as ``input``, ``completion_tokens`` as ``output``, ``cached_tokens``
as ``cache_read``; Anthropic's four counts; the Responses API's ``input_tokens`` less
``cached_tokens``...); streams read in their own usage events; an answer the client
never got counts with ``relayed="false"``. "Metrics": ``sidecar_tokens_total{route,
upstream, model, kind, relayed}``. "Logs": the ``request`` line's ``input_tokens``,
``output_tokens``, ``cache_read_tokens`` (null when not reported).

The expected counts are :data:`sidecar.testing.turn_shapes.EXPECTED_TOKENS`. Every test
uses upstream and route names of its own (:func:`~tests.turn_helpers.unique`), so the
series it reads are only its own in the process-global registry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from sidecar.testing import FakeUpstream, Fault, turn_shapes
from sidecar.testing.render import SSE, split
from tests.access_log_helpers import Lines, capture
from tests.conftest import StartSidecar
from tests.turn_helpers import (
    EXPECTED,
    TOKENS,
    WAIT_S,
    Metrics,
    chain_config,
    doc_of,
    healthy,
    path_of,
    post,
    scrape,
    sent_by,
    unique,
)

REASONING = [
    "openai_reasoning_stream",
    "openrouter_reasoning_stream",
    "anthropic_thinking_stream",
    "responses_reasoning_stream",
]
CACHED = [
    f"{family}_cached_{framing}"
    for family in ("openai", "anthropic", "responses")
    for framing in ("json", "stream")
]
LENGTH_CUTS = [
    "openai_length_empty_stream",
    "anthropic_max_tokens_empty_stream",
    "responses_incomplete_empty_stream",
    "openai_length_empty_json",
    "anthropic_max_tokens_empty_json",
    "responses_incomplete_empty_json",
]
EMPTY_TURNS = [
    "openai_empty_stream",
    "anthropic_empty_stream",
    "responses_empty_stream",
    "openai_empty_json",
    "anthropic_empty_json",
    "responses_empty_json",
]
LOG_FIELDS = {"input": "input_tokens", "output": "output_tokens", "cache_read": "cache_read_tokens"}


@pytest.fixture
def access() -> Iterator[Lines]:
    yield from capture()


def floats(counts: dict[str, int], times: int = 1) -> dict[str, float]:
    return {kind: float(n * times) for kind, n in counts.items()}


def counted(m: Metrics, **labels: str) -> dict[str, float]:
    """``sidecar_tokens_total`` by kind over the series matching ``labels``, kinds with
    a count only (a kind at 0 is not counted: :func:`test_kinds_not_reported_have_no_series`
    asks whether its series may exist at all)."""
    return {kind: n for kind, n in m.tokens(**labels).items() if n}


def assert_logged(line: dict[str, object], expected: dict[str, int]) -> None:
    """The access-log line's token fields: the expected counts, null when not reported."""
    got = {field: line.get(field, "missing") for field in LOG_FIELDS.values()}
    assert got == {field: expected.get(kind) for kind, field in LOG_FIELDS.items()}


# -- 8. the counters equal the reported usage -----------------------------------------


@pytest.mark.parametrize("shape", REASONING + CACHED + LENGTH_CUTS + EMPTY_TURNS)
async def test_token_counters_equal_the_reported_usage(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    shape: str,
) -> None:
    """Contract, "Tokens are metered": one relayed answer adds exactly its reported
    usage to ``sidecar_tokens_total{..., relayed="true"}``, kind by kind, and no other
    kind; the access log's ``request`` line carries the same ``input_tokens``,
    ``output_tokens`` and ``cache_read_tokens``. (Empty turns are relayed here with
    ``empty_turn_is_failure = false``; chat streams ask ``include_usage``.)"""
    route, up = unique("tkroute"), unique("tkup")
    keys: dict[str, Any] = {"empty_turn_is_failure": False} if shape in EMPTY_TURNS else {}
    sc = await start_sidecar(chain_config(fake.url, names=(up, "unused"), route=route, **keys))
    fake.set_default(Fault(shape=shape))
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.upstream) == (200, up)
    assert a.body == sent_by(fake)
    m = await scrape(http, sc)
    expected = EXPECTED[shape]
    assert counted(m, route=route, upstream=up, model="*", relayed="true") == floats(expected)
    series = m.labelsets(TOKENS, route=route)
    assert set(expected) <= {s["kind"] for s in series}
    assert all((s["upstream"], s["model"], s["relayed"]) == (up, "*", "true") for s in series)
    (line,) = await access.wait(1)
    assert_logged(line, expected)


@pytest.mark.parametrize(
    ("shape", "include_usage"),
    [
        ("openai_cached_json", True),  # OpenAI-style: no cache_write
        ("openai_reasoning_stream", True),
        ("responses_cached_stream", True),  # Responses API: no cache_write
        ("openai_cached_stream", False),  # no usage reported at all
        ("responses_failed_stream", True),  # "usage": null
    ],
)
async def test_kinds_not_reported_have_no_series(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    shape: str,
    include_usage: bool,
) -> None:
    """Contract, "Tokens are metered": each answer's usage is counted as the provider
    reports it (OpenAI-style and Responses usage map to ``input``, ``output`` and
    ``cache_read`` only; usage that cannot be read is ignored). Expected: a kind the
    answer does not report (``cache_write`` of an OpenAI-style or Responses answer;
    every kind of an answer without usage) has no ``sidecar_tokens_total`` series, so
    a dashboard never shows a provider's kind it does not have."""
    route, up = unique("tkroute"), unique("tkup")
    sc = await start_sidecar(chain_config(fake.url, names=(up, "unused"), route=route))
    fake.set_default(Fault(shape=shape))
    a = await post(http, sc, path_of(shape), doc_of(shape, include_usage=include_usage))
    assert a.status == 200
    m = await scrape(http, sc)
    expected = EXPECTED[shape] if include_usage else {}
    assert sorted(s["kind"] for s in m.labelsets(TOKENS, route=route)) == sorted(expected)


async def test_two_answers_add_up(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """Contract, "Tokens are metered": a counter, each answer's usage added once."""
    route, up = unique("tkroute"), unique("tkup")
    sc = await start_sidecar(chain_config(fake.url, names=(up, "unused"), route=route))
    fake.script([Fault(shape="anthropic_cached_stream"), Fault(shape="anthropic_cached_json")])
    for shape in ("anthropic_cached_stream", "anthropic_cached_json"):
        assert (await post(http, sc, path_of(shape), doc_of(shape))).status == 200
    m = await scrape(http, sc)
    a, b = EXPECTED["anthropic_cached_stream"], EXPECTED["anthropic_cached_json"]
    assert counted(m, route=route, relayed="true") == {k: float(a[k] + b[k]) for k in a}


@pytest.mark.parametrize(
    ("shape", "include_usage"),
    [
        ("openai_cached_stream", False),  # usage only when the client asks for it
        ("openai_reasoning_stream", False),
        ("responses_failed_stream", True),  # "usage": null
        ("responses_error_event_stream", True),  # no usage at all
    ],
)
async def test_an_answer_without_usage_meters_nothing_and_logs_null(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    shape: str,
    include_usage: bool,
) -> None:
    """Contract, "Tokens are metered": counted from what the provider reports, never
    estimated: an answer that reports none adds no series; "Logs": the token fields are
    null when not reported. (The failed Responses streams are the last candidate's
    answers, relayed as they came.)"""
    route, up = unique("tkroute"), unique("tkup")
    sc = await start_sidecar(chain_config(fake.url, names=(up, "unused"), route=route))
    fake.set_default(Fault(shape=shape))
    a = await post(http, sc, path_of(shape), doc_of(shape, include_usage=include_usage))
    assert a.status == 200 and a.body == sent_by(fake)
    m = await scrape(http, sc)
    assert counted(m, route=route) == {}
    (line,) = await access.wait(1)
    assert_logged(line, {})


# -- 9. an abandoned empty turn is metered relayed="false" ------------------------------


@pytest.mark.parametrize("retries", [1, 0])
@pytest.mark.parametrize("shape", EMPTY_TURNS)
async def test_an_abandoned_empty_turn_is_metered_relayed_false(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    shape: str,
    retries: int,
) -> None:
    """Contract, "Tokens are metered": an answer the client never got (an empty turn
    retried, or fallen back from) counts with ``relayed="false"`` on its upstream's
    series; the answer relayed counts with ``relayed="true"`` on its own."""
    route, up, backup = unique("tkroute"), unique("tkup"), unique("tkbackup")
    sc = await start_sidecar(
        chain_config(fake.url, fake2.url, retries=retries, names=(up, backup), route=route)
    )
    fake.set_default(Fault(shape=shape))
    relayed = healthy(shape)
    fake2.set_default(Fault(shape=relayed))
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.upstream) == (200, backup)
    n = 2 if retries else 1
    assert fake.request_count == n
    m = await scrape(http, sc)
    assert counted(m, route=route, upstream=up, relayed="false") == floats(EXPECTED[shape], n)
    assert counted(m, route=route, upstream=up, relayed="true") == {}
    assert counted(m, route=route, upstream=backup, relayed="true") == floats(EXPECTED[relayed])
    assert counted(m, route=route, upstream=backup, relayed="false") == {}
    (line,) = await access.wait(1)
    assert_logged(line, EXPECTED[relayed])


@pytest.mark.parametrize("shape", EMPTY_TURNS)
async def test_the_last_candidates_empty_turn_meters_its_retried_answer_false(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    shape: str,
) -> None:
    """Contract, "Tokens are metered" and "An empty turn is a failure": on the last
    candidate the first empty answer is retried (never relayed: ``relayed="false"``),
    the second is relayed as it came (``relayed="true"``)."""
    route, up = unique("tkroute"), unique("tkup")
    sc = await start_sidecar(chain_config(fake.url, retries=2, names=(up, "unused"), route=route))
    fake.set_default(Fault(shape=shape))
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.upstream, fake.request_count) == (200, up, 2)
    m = await scrape(http, sc)
    assert counted(m, route=route, upstream=up, relayed="false") == floats(EXPECTED[shape])
    assert counted(m, route=route, upstream=up, relayed="true") == floats(EXPECTED[shape])
    (line,) = await access.wait(1)
    assert_logged(line, EXPECTED[shape])


# -- 10. usage split across writes -------------------------------------------------------

SPLIT_STREAMS = ["openai_cached_stream", "anthropic_cached_stream", "responses_cached_stream"]


def stream_bytes(shape: str) -> bytes:
    """The bytes of ``shape`` as the fake renders it for a first request of model ``m``
    (with ``include_usage``)."""
    rendered = turn_shapes.render_shape(shape, "m", "fake000001", include_usage=True)
    return b"".join(rendered.chunks)


@pytest.mark.parametrize("writes", [3, 17, 101, 1000])
@pytest.mark.parametrize("shape", [*SPLIT_STREAMS, "anthropic_thinking_stream"])
async def test_usage_cut_into_many_writes_still_meters_exactly(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    shape: str,
    writes: int,
) -> None:
    """Contract, "Tokens are metered": the relay finds the usage events whatever the
    upstream's writes are: the stream's bytes in ``writes`` arbitrary slices (lines and
    JSON cut anywhere) meter the same counts."""
    route, up = unique("tkroute"), unique("tkup")
    sc = await start_sidecar(chain_config(fake.url, names=(up, "unused"), route=route))
    body = stream_bytes(shape)
    fake.set_default(Fault(body=body, content_type=SSE, chunks=writes))
    a = await post(http, sc, path_of(shape), doc_of(shape))
    assert (a.status, a.body) == (200, body)
    m = await scrape(http, sc)
    assert counted(m, route=route, upstream=up, relayed="true") == floats(EXPECTED[shape])
    (line,) = await access.wait(1)
    assert_logged(line, EXPECTED[shape])


@pytest.mark.parametrize("shape", SPLIT_STREAMS)
async def test_usage_line_cut_after_the_commit_point_still_meters_exactly(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    shape: str,
) -> None:
    """Contract, "Tokens are metered": the last usage event's line is cut in two (the
    fake holds in the middle of its usage object, after the commit point, until the
    client has every byte before the cut), so the relay reads it in two pieces; the
    counts are still exact (Anthropic's ``message_delta`` output count, not
    ``message_start``'s, among them)."""
    route, up = unique("tkroute"), unique("tkup")
    sc = await start_sidecar(chain_config(fake.url, names=(up, "unused"), route=route))
    body = stream_bytes(shape)
    writes = len(body) // 40
    slices = split(body, writes)
    usage_at = body.rindex(b'"usage":{')
    line_end = body.index(b"\n", usage_at)
    ends = [sum(len(s) for s in slices[: i + 1]) for i in range(len(slices))]
    k = next(i + 1 for i, end in enumerate(ends) if usage_at + len(b'"usage":{') < end < line_end)
    before_cut = b"".join(slices[:k])
    gate = asyncio.Event()
    fake.set_default(Fault(body=body, content_type=SSE, chunks=writes, hold_after_chunks=(k, gate)))
    try:
        async with (
            asyncio.timeout(WAIT_S),
            http.post(sc.proxy_url + path_of(shape), json=doc_of(shape)) as r,
        ):
            assert r.status == 200
            got = await r.content.readexactly(len(before_cut))
            assert got == before_cut
            gate.set()
            got += await r.read()
    finally:
        gate.set()
    assert got == body
    m = await scrape(http, sc)
    assert counted(m, route=route, upstream=up, relayed="true") == floats(EXPECTED[shape])
    (line,) = await access.wait(1)
    assert_logged(line, EXPECTED[shape])

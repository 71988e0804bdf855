"""Traces (contract, "Traces"), end to end: the real sidecar, fake upstreams and a real
OTLP/HTTP collector on loopback that decodes what it receives with OpenTelemetry's own
protobuf definitions (:mod:`tests.otlp_collector`).

Spans are collected deterministically: :meth:`sidecar.tracing.runtime.Tracing.flush`
exports every ended span before the test reads the collector (no wait on the batch
processor's timer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from sidecar.config import load_config
from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault
from sidecar.testing.net import closed_port
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar, metric
from tests.deploy_tools import load_tool
from tests.otlp_collector import CLIENT, SERVER, OtlpCollector, attrs, strings

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-01"
UNSAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-00"
DROPPED = "sidecar_trace_spans_dropped_total"


@pytest.fixture(autouse=True)
def exports_only_when_flushed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch processor's timer (5 s by default) never sends a partial batch during a
    test, however slow the machine: spans go out on :func:`flush` or a full batch."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """Every test here ends with no export thread left (set up before the sidecar, so
    checked after it stopped: its tracer's shutdown joins the batch processor's thread)."""
    before = set(threading.enumerate())
    yield
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == []


@pytest_asyncio.fixture
async def collector() -> AsyncIterator[OtlpCollector]:
    async with OtlpCollector() as c:
        yield c


def traced(
    endpoint: str,
    primary_url: str,
    backup_url: str | None = None,
    *,
    primary: Mapping[str, Any] | None = None,
    backup: Mapping[str, Any] | None = None,
    **tracing: Any,
) -> str:
    """``primary`` (then ``backup``) under route ``chat`` on ``/v1/``, and ``[tracing]``
    at ``endpoint`` with ``tracing`` keys."""
    ups = {"primary": upstream(primary_url, **(primary or {}))}
    names = ["primary"]
    if backup_url is not None:
        ups["backup"] = upstream(backup_url, **(backup or {}))
        names.append("backup")
    return config(
        upstreams=ups,
        routes=[route("chat", *names, path_prefix="/v1/")],
        tracing={"otlp_endpoint": endpoint, **tracing},
    )


async def post(
    http: aiohttp.ClientSession, sc: Sidecar, headers: Mapping[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    async with http.post(sc.proxy_url + CHAT, json=BODY, headers=headers or {}) as r:
        return r.status, await r.json()


async def flush(sc: Sidecar) -> None:
    assert sc.tracing is not None
    async with asyncio.timeout(10):
        await sc.tracing.flush()


def by_attempt(spans: list[Any]) -> list[dict[str, Any]]:
    """CLIENT spans' attributes in attempt order."""
    return sorted((attrs(s.attributes) for s in spans), key=lambda a: a["sidecar.attempt"])


@pytest.mark.timeout(30)
async def test_a_retry_and_a_fallback_are_three_client_spans_under_the_apps_trace(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(
        traced(
            collector.endpoint,
            fake.url,
            fake2.url,
            primary={
                "retry": {"max_retries": 1, "backoff_initial_ms": 1, "jitter": False},
                "circuit_breaker": {"failure_threshold": 5},
            },
        )
    )
    fake.script([Fault(status=503), Fault(status=503)])
    async with asyncio.timeout(10):
        status, body = await post(http, sc, {"traceparent": SAMPLED, "tracestate": "app=1"})
    assert status == 200
    await flush(sc)

    [server] = collector.of_kind(SERVER)
    clients = collector.of_kind(CLIENT)
    assert len(clients) == 3 and len(collector.spans) == 4
    # The SERVER span is the app's span's child, in the app's trace.
    assert server.trace_id.hex() == TRACE_ID
    assert server.parent_span_id.hex() == PARENT_ID
    assert server.name == "POST chat"
    assert attrs(server.attributes) == {
        "http.request.method": "POST",
        "url.path": CHAT,
        "http.response.status_code": 200,
        "sidecar.route": "chat",
        "sidecar.outcome": "ok",
    }
    for c in clients:
        assert c.trace_id == server.trace_id
        assert c.parent_span_id == server.span_id
        assert c.name == "chat m"
        assert server.start_time_unix_nano <= c.start_time_unix_nano
        assert c.end_time_unix_nano <= server.end_time_unix_nano
    common = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "m",
        "server.address": "127.0.0.1",
    }
    usage = body["usage"]
    assert by_attempt(clients) == [
        {
            **common,
            "sidecar.upstream": "primary",
            "sidecar.attempt": 1,
            "sidecar.attempt.reason": "first",
            "sidecar.breaker.state": "closed",
            "http.response.status_code": 503,
            "error.type": "http_5xx",
        },
        {
            **common,
            "sidecar.upstream": "primary",
            "sidecar.attempt": 2,
            "sidecar.attempt.reason": "retry",
            "sidecar.breaker.state": "closed",
            "http.response.status_code": 503,
            "error.type": "http_5xx",
        },
        {
            **common,
            "sidecar.upstream": "backup",
            "sidecar.attempt": 3,
            "sidecar.attempt.reason": "fallback",
            "sidecar.breaker.state": "none",
            "http.response.status_code": 200,
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": usage["completion_tokens"],
        },
    ]
    # The commit point is an event on the relayed attempt's span, and only there.
    events = {attrs(c.attributes)["sidecar.attempt"]: list(c.events) for c in clients}
    assert events[1] == [] and events[2] == []
    [commit] = events[3]
    assert commit.name == "sidecar.commit"
    assert set(attrs(commit.attributes)) == {"sidecar.time_to_first_output_ms"}
    # The failed attempts' spans are errors; the relayed one is not.
    codes = {attrs(c.attributes)["sidecar.attempt"]: c.status.code for c in clients}
    assert codes[1] == codes[2] == 2 and codes[3] == 0  # STATUS_CODE_ERROR, UNSET
    assert collector.resources[0]["service.name"] == "sidecar"


@pytest.mark.timeout(30)
async def test_a_candidate_skipped_by_its_breaker_is_an_event_on_the_server_span(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(
        traced(
            collector.endpoint,
            fake.url,
            fake2.url,
            primary={"retry": {"max_retries": 0}, "circuit_breaker": {"failure_threshold": 1}},
            service_name="llm-sidecar",
        )
    )
    fake.script([Fault(status=503)])
    async with asyncio.timeout(10):
        assert (await post(http, sc))[0] == 200  # the primary fails once: its breaker opens
        assert (await post(http, sc))[0] == 200  # skipped
    await flush(sc)
    servers = collector.of_kind(SERVER)
    assert len(servers) == 2
    second = max(servers, key=lambda s: s.start_time_unix_nano)
    [skip] = second.events
    assert skip.name == "sidecar.skipped"
    assert attrs(skip.attributes) == {
        "sidecar.upstream": "primary",
        "gen_ai.request.model": "m",
        "sidecar.reason": "circuit_open",
    }
    [client] = [c for c in collector.of_kind(CLIENT) if c.trace_id == second.trace_id]
    a = attrs(client.attributes)
    assert (a["sidecar.upstream"], a["sidecar.attempt"], a["sidecar.attempt.reason"]) == (
        "backup",
        1,
        "fallback",
    )
    assert {r["service.name"] for r in collector.resources} == {"llm-sidecar"}
    # Without a traceparent: a new trace, a root SERVER span.
    assert second.parent_span_id == b""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("propagate", [True, False])
async def test_propagate_puts_the_attempts_span_in_the_upstream_traceparent(
    fake: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    propagate: bool,
) -> None:
    sc = await start_sidecar(traced(collector.endpoint, fake.url, propagate=propagate))
    async with asyncio.timeout(10):
        assert (await post(http, sc, {"traceparent": SAMPLED, "tracestate": "app=1"}))[0] == 200
        assert (await post(http, sc))[0] == 200  # no traceparent from the app
    await flush(sc)
    with_parent, without = fake.requests
    clients = {c.trace_id.hex(): c for c in collector.of_kind(CLIENT)}
    assert len(clients) == 2
    mine = clients[TRACE_ID]
    [(other_trace, other)] = [(t, c) for t, c in clients.items() if t != TRACE_ID]
    if propagate:
        assert with_parent.headers.getall("traceparent") == [
            f"00-{TRACE_ID}-{mine.span_id.hex()}-01"
        ]
        assert without.headers.getall("traceparent") == [
            f"00-{other_trace}-{other.span_id.hex()}-01"
        ]
    else:  # the app's own headers go on as they came, and nothing is added
        assert with_parent.headers.getall("traceparent") == [SAMPLED]
        assert "traceparent" not in without.headers
    assert with_parent.headers.getall("tracestate") == ["app=1"]  # relayed as it came


@pytest.mark.timeout(30)
async def test_sample_ratio_zero_exports_nothing_but_a_sampled_parent_decides(
    fake: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(traced(collector.endpoint, fake.url, sample_ratio=0.0))
    async with asyncio.timeout(10):
        for _ in range(3):
            assert (await post(http, sc))[0] == 200
        assert (await post(http, sc, {"traceparent": UNSAMPLED}))[0] == 200
    await flush(sc)
    assert collector.posts == 0 and collector.spans == []

    async with asyncio.timeout(10):
        assert (await post(http, sc, {"traceparent": SAMPLED}))[0] == 200
    await flush(sc)
    assert [s.kind for s in collector.spans].count(SERVER) == 1
    assert [s.kind for s in collector.spans].count(CLIENT) == 1
    assert {s.trace_id.hex() for s in collector.spans} == {TRACE_ID}


@pytest.mark.timeout(30)
async def test_an_unsampled_parent_is_not_traced_even_at_ratio_one(
    fake: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(traced(collector.endpoint, fake.url, sample_ratio=1.0))
    async with asyncio.timeout(10):
        assert (await post(http, sc, {"traceparent": UNSAMPLED}))[0] == 200
        assert (await post(http, sc, {"traceparent": "00-zz-not-a-traceparent"}))[0] == 200
    await flush(sc)
    # The malformed one starts a new trace (sampled at ratio 1); the unsampled parent
    # is obeyed.
    [server] = collector.of_kind(SERVER)
    assert server.trace_id.hex() != TRACE_ID and server.parent_span_id == b""


CANARIES = {
    "body": "canary-body-7f3a9c",
    "auth": "sk-canary-auth-51d2e8",
    "key": "sk-canary-envkey-90b4c1",
    "header": "canary-header-2e6f0d",
    "query": "canary-query-c81b37",
}


@pytest.mark.timeout(30)
async def test_no_span_holds_a_body_a_header_value_a_key_or_a_query(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """Every exported attribute, event attribute and resource value is scanned for the
    canaries, and so are the raw export bodies (names, anything else)."""
    sc = await start_sidecar(
        traced(
            collector.endpoint,
            fake.url,
            fake2.url,
            primary={"retry": {"max_retries": 0}, "circuit_breaker": {"failure_threshold": 1}},
            backup={"api_key_env": "BACKUP_KEY"},
            propagate=True,
        ),
        environ={"BACKUP_KEY": CANARIES["key"]},
    )
    fake.set_default(Fault(status=503))
    body = {**BODY, "messages": [{"role": "user", "content": CANARIES["body"]}]}
    headers = {
        "authorization": f"Bearer {CANARIES['auth']}",
        "x-custom": CANARIES["header"],
        "traceparent": SAMPLED,
    }
    url = f"{sc.proxy_url}{CHAT}?api-key={CANARIES['query']}"
    async with asyncio.timeout(10):
        for _ in range(2):  # a failure and a fallback, then a skip and the backup
            async with http.post(url, json=body, headers=headers) as r:
                assert r.status == 200
                await r.read()
    await flush(sc)
    assert fake2.requests[0].headers["authorization"] == f"Bearer {CANARIES['key']}"
    assert len(collector.of_kind(SERVER)) == 2 and len(collector.of_kind(CLIENT)) == 3
    seen: list[str] = []
    for span in collector.spans:
        seen += [span.name, *strings(span.attributes)]
        for event in span.events:
            seen += [event.name, *strings(event.attributes)]
    for resource in collector.resources:
        seen += [f"{k}={v}" for k, v in resource.items()]
    assert any(s == CHAT for s in seen)  # the scan sees the values
    for what, canary in CANARIES.items():
        assert not [s for s in seen if canary in s], what
        assert not [b for b in collector.bodies if canary.encode() in b], what


class RootRecords(logging.Handler):
    """The records that reach the root logger (where the sidecar's JSON lines go)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.timeout(30)
async def test_a_collector_that_answers_500_costs_nothing_and_its_spans_are_counted(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar")
    at_root = RootRecords()
    logging.getLogger().addHandler(at_root)
    try:
        async with OtlpCollector(status=500) as refusing:
            sc = await start_sidecar(traced(refusing.endpoint, fake.url))
            before = await metric(http, sc, DROPPED)
            async with asyncio.timeout(10):
                for _ in range(3):
                    assert (await post(http, sc))[0] == 200
            await flush(sc)
            assert refusing.posts >= 1 and len(refusing.spans) == 6  # sent, refused
            assert await metric(http, sc, DROPPED) - before == 6
            # The counter passes CI's exposition and contract check (a counter, no labels).
            async with http.get(sc.admin_url + "/metrics") as r:
                text = await r.text()
            assert "# TYPE sidecar_trace_spans_dropped_total counter" in text
            problems = load_tool("check_metrics").check(text)[0]
            assert [p for p in problems if "sidecar_trace" in p] == []
    finally:
        logging.getLogger().removeHandler(at_root)
    events = {r.getMessage(): r.__dict__["fields"] for r in caplog.records if r.name == "sidecar"}
    assert events["tracing_started"] == {
        "collector": f"127.0.0.1:{refusing.endpoint.split(':')[2].split('/')[0]}",
        "sample_ratio": 1.0,
        "propagate": False,
        "service_name": "sidecar",
    }
    assert events["trace_export_failed"] == {"spans": 6}  # the one export of the six
    # OpenTelemetry's own records (a failed export logs one) never reach the root
    # logger, whose handler writes the sidecar's JSON lines.
    assert [r for r in at_root.records if r.name.startswith("opentelemetry")] == []
    assert [r for r in at_root.records if r.name == "sidecar"] != []  # the check sees


@pytest.mark.timeout(30)
async def test_a_collector_that_is_down_costs_nothing_and_its_spans_are_counted(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The exporter's own deadline for one export, retries included (seconds).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")
    sc = await start_sidecar(traced(f"http://127.0.0.1:{closed_port()}/v1/traces", fake.url))
    before = await metric(http, sc, DROPPED)
    async with asyncio.timeout(10):
        for _ in range(2):
            assert (await post(http, sc))[0] == 200
    await flush(sc)
    assert await metric(http, sc, DROPPED) - before == 4


@pytest.mark.timeout(30)
async def test_a_slow_collector_never_delays_a_request_and_the_queue_stays_bounded(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collector takes the first export and never answers while the test runs:
    requests still answer, the queue holds at most OTEL_BSP_MAX_QUEUE_SIZE spans, and
    every span past it is dropped and counted (memory stays bounded)."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    gate = asyncio.Event()
    async with OtlpCollector(gate=gate) as slow:
        sc = await start_sidecar(traced(slow.endpoint, fake.url))
        before = await metric(http, sc, DROPPED)
        async with asyncio.timeout(10):
            assert (await post(http, sc))[0] == 200  # its 2 spans: one batch, sent
            await slow.wait_for_post()  # the export thread now waits on the collector
            n = 20
            for _ in range(n):
                assert (await post(http, sc))[0] == 200
        assert slow.posts == 1 and not gate.is_set()  # all answered, the export still held
        assert await metric(http, sc, DROPPED) - before == 2 * n - 4  # the queue holds 4
        gate.set()  # the collector answers: the queue drains
        await flush(sc)
        assert len(slow.spans) == 2 + 4


@pytest.mark.timeout(30)
async def test_the_relayed_attempts_span_lasts_the_whole_stream_and_holds_its_usage(
    fake: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """A streamed answer: the committed CLIENT span ends with the relay (not at the commit
    point), and carries the usage the stream reported in its last chunk."""
    sc = await start_sidecar(traced(collector.endpoint, fake.url))
    gate = asyncio.Event()
    fake.script([Fault(hold_after_chunks=(3, gate))])
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    async with asyncio.timeout(10), http.post(sc.proxy_url + CHAT, json=body) as r:
        assert r.status == 200
        await r.content.readline()  # the stream is committed and relayed
        await fake.wait_until(lambda: fake.active_requests == 1)
        await flush(sc)
        assert collector.spans == []  # nothing ended yet: the stream is still going
        released_ns = time.time_ns()
        gate.set()
        text = (await r.read()).decode()
    await flush(sc)
    [client] = collector.of_kind(CLIENT)
    [commit] = client.events
    assert commit.name == "sidecar.commit" and commit.time_unix_nano < released_ns
    assert client.end_time_unix_nano >= released_ns
    usage = next(
        json.loads(line[6:])["usage"]
        for line in text.splitlines()
        if line.startswith("data: {") and '"usage": {' in line.replace('":{', '": {')
    )
    a = attrs(client.attributes)
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]


@pytest.mark.timeout(30)
async def test_a_reload_that_changes_tracing_says_it_needs_a_restart(
    tmp_path: Path,
    fake: FakeUpstream,
    collector: OtlpCollector,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The tracer is the process's, made at start: a reload that changes ``[tracing]``
    is accepted for the rest, logs that tracing waits for a restart, and tracing goes
    on as it started."""
    path = tmp_path / "sidecar.toml"
    path.write_text(traced(collector.endpoint, fake.url))
    sc = Sidecar(
        load_config(str(path), {}),
        environ={},
        clock=clock,
        proxy_listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        config_path=str(path),
        watch_interval_s=3600,
    )
    await sc.start()
    try:
        with caplog.at_level(logging.INFO, logger="sidecar"):
            path.write_text(traced(collector.endpoint, fake.url, sample_ratio=0.0))
            assert await sc.reload()
        said = [r.getMessage() for r in caplog.records if r.name == "sidecar"]
        assert "config_tracing_changed_needs_restart" in said
        async with asyncio.timeout(10):
            assert (await post(http, sc))[0] == 200
        await flush(sc)
        assert len(collector.spans) == 2  # still sample_ratio 1.0
    finally:
        await sc.stop()


@pytest.mark.timeout(30)
async def test_a_half_open_breakers_probe_is_an_attempt_of_reason_probe(
    fake: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(
        traced(
            collector.endpoint,
            fake.url,
            primary={
                "retry": {"max_retries": 0},
                "circuit_breaker": {"failure_threshold": 1, "cooldown_ms": 1000},
            },
        )
    )
    fake.script([Fault(status=503)])
    async with asyncio.timeout(10):
        assert (await post(http, sc))[0] == 503  # the breaker opens
        clock.advance(1.0)  # cooldown over: half_open, one probe admitted
        assert (await post(http, sc))[0] == 200  # the probe, which closes it
    await flush(sc)
    assert [
        (a["sidecar.attempt.reason"], a["sidecar.breaker.state"])
        for a in sorted(
            (attrs(c.attributes) for c in collector.of_kind(CLIENT)),
            key=lambda a: a.get("error.type", ""),
            reverse=True,
        )
    ] == [("first", "closed"), ("probe", "half_open")]
    outcomes = sorted(attrs(s.attributes)["sidecar.outcome"] for s in collector.of_kind(SERVER))
    assert outcomes == ["ok", "upstream_error"]


@pytest.mark.timeout(30)
async def test_a_hedge_is_its_own_client_span_and_the_loser_ends_cancelled(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """A route with ``hedge_after_ms``: the primary holds its answer past it, the hedge
    to the backup answers first: two CLIENT spans under the SERVER span, numbered in
    the order they were sent, the second with reason ``hedge`` and the commit event,
    the first ended ``cancelled`` (contract: "each retry, fallback, probe and hedge
    included")."""
    toml = config(
        upstreams={
            "primary": upstream(fake.url, retry={"max_retries": 0}),
            "backup": upstream(fake2.url, retry={"max_retries": 0}),
        },
        routes=[route("chat", "primary", "backup", path_prefix="/v1/", hedge_after_ms=1000)],
        tracing={"otlp_endpoint": collector.endpoint},
    )
    sc = await start_sidecar(toml)
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))  # headers, then nothing
    call = asyncio.ensure_future(post(http, sc, {"traceparent": SAMPLED}))
    async with asyncio.timeout(5):
        await fake.wait_for_requests(1)
    clock.advance(1.0)  # hedge_after_ms passes: the backup gets its copy and answers
    async with asyncio.timeout(10):
        status, _ = await call
    assert status == 200
    await flush(sc)

    [server] = collector.of_kind(SERVER)
    first, hedge = by_attempt(collector.of_kind(CLIENT))
    assert (first["sidecar.attempt"], first["sidecar.upstream"]) == (1, "primary")
    assert first["sidecar.attempt.reason"] == "first"
    assert first["error.type"] == "cancelled"
    assert (hedge["sidecar.attempt"], hedge["sidecar.upstream"]) == (2, "backup")
    assert hedge["sidecar.attempt.reason"] == "hedge"
    assert "error.type" not in hedge
    [hedge_span] = [
        s for s in collector.of_kind(CLIENT) if attrs(s.attributes)["sidecar.upstream"] == "backup"
    ]
    assert [e.name for e in hedge_span.events] == ["sidecar.commit"]
    assert all(s.parent_span_id == server.span_id for s in collector.of_kind(CLIENT))
    assert attrs(server.attributes)["sidecar.outcome"] == "ok"


@pytest.mark.timeout(30)
async def test_an_attempt_cut_while_it_waited_for_a_connection_is_no_client_span(
    fake: FakeUpstream,
    collector: OtlpCollector,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """An attempt waiting for a pooled connection (``max_connections`` busy) that the
    request deadline cuts was never sent: ``x-sidecar-attempts`` says 0, and so does
    the trace (docs/tracing.md: ``sidecar.attempt`` is the ``x-sidecar-attempts``
    count): a SERVER span (504) with no CLIENT span under it, not one ``cancelled``."""
    toml = config(
        server={"request_timeout_ms": 300},
        upstreams={"primary": upstream(fake.url, max_connections=1)},
        routes=[route("chat", "primary", path_prefix="/v1/")],
        tracing={"otlp_endpoint": collector.endpoint},
    )
    sc = await start_sidecar(toml)
    gate = asyncio.Event()
    fake.script([Fault(hold_after_chunks=(2, gate))])  # a committed stream holds the connection
    holder = await http.post(sc.proxy_url + CHAT, json={**BODY, "stream": True})
    try:
        assert holder.status == 200
        assert (await holder.content.readany()).startswith(b"data: ")
        queued = asyncio.ensure_future(
            http.post(sc.proxy_url + CHAT, json=BODY, headers={"traceparent": SAMPLED})
        )
        assert sc.runtime is not None
        pool = sc.runtime.current.upstreams["primary"].pool
        assert pool is not None
        for _ in range(10_000):
            if pool.waiting:
                break
            await asyncio.sleep(0)
        else:
            raise AssertionError("never queued")
        clock.advance(0.3)
        async with asyncio.timeout(10), await queued as r:
            assert (r.status, r.headers["x-sidecar-attempts"]) == (504, "0")
    finally:
        gate.set()
        await holder.read()
        holder.release()
    await flush(sc)
    [server] = [s for s in collector.of_kind(SERVER) if s.trace_id.hex() == TRACE_ID]
    assert attrs(server.attributes)["http.response.status_code"] == 504
    assert [c for c in collector.of_kind(CLIENT) if c.trace_id.hex() == TRACE_ID] == []

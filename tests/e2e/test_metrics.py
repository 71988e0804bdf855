"""Prometheus metrics, black-box: real traffic through the sidecar, ``/metrics`` over HTTP.

Contract, "Metrics": names, types and labels; label values from config names only;
the one-hot breaker state gauge; then exact counter deltas for what an operator
reads off a dashboard (successes, retries, fallbacks, breaker openings, rejections,
probes, closings, attempts by outcome, requests by route and code, latency
histograms, in-flight requests).

The registry is process-global (one across all tests): every assertion is on a
delta between two scrapes, and every test uses upstream and route names of its
own. No wall-clock sleeps: responses are held with :class:`asyncio.Event` gates,
breaker time moves with the :class:`~sidecar.testing.FakeClock`, and the only waits
are bounded ones on the fake upstream's state or on event-loop turns.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import string
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDictProxy
from prometheus_client.parser import text_string_to_metric_families

from sidecar.server import Sidecar
from sidecar.testing import FAULT_HEADER, FakeClock, FakeUpstream, Fault, closed_port
from tests import configs
from tests.conftest import StartSidecar, on_fake_time, status

WAIT_S = 5.0
"""Bound on any wait (a failure, never a pace)."""

CONTRACT: dict[str, tuple[str, frozenset[str]]] = {
    "sidecar_requests_total": ("counter", frozenset({"route", "code"})),
    "sidecar_request_duration_seconds": ("histogram", frozenset({"route"})),
    "sidecar_upstream_attempts_total": ("counter", frozenset({"upstream", "model", "outcome"})),
    "sidecar_upstream_first_byte_seconds": ("histogram", frozenset({"upstream", "model"})),
    "sidecar_retries_total": ("counter", frozenset({"upstream", "model"})),
    "sidecar_fallbacks_total": ("counter", frozenset({"route", "upstream", "reason"})),
    "sidecar_breaker_state": ("gauge", frozenset({"upstream", "model", "state"})),
    "sidecar_breaker_transitions_total": ("counter", frozenset({"upstream", "model", "to"})),
    "sidecar_breaker_rejections_total": ("counter", frozenset({"upstream", "model"})),
    "sidecar_inflight_requests": ("gauge", frozenset()),
    "sidecar_slow_calls_total": ("counter", frozenset({"upstream", "model"})),
}
"""The contract's table: name -> (type, label names)."""

EXTRA: dict[str, tuple[str, frozenset[str]]] = {
    "sidecar_config_reloads_total": ("counter", frozenset({"result"})),
    "sidecar_stream_aborts_total": ("counter", frozenset({"upstream", "model", "reason"})),
    # In the contract's table; samples only after a ramping recovery (test_ramp_e2e.py).
    "sidecar_ramp_skips_total": ("counter", frozenset({"upstream", "model"})),
    # In the contract's table; samples only on a route with affinity_header
    # (test_affinity_e2e.py).
    "sidecar_affinity_total": ("counter", frozenset({"route", "result"})),
    "sidecar_tokens_total": (
        "counter",
        frozenset({"route", "upstream", "model", "kind", "relayed"}),
    ),
    # In the contract's table; samples only once a retry was skipped (test_retry_budget.py).
    "sidecar_retries_skipped_total": ("counter", frozenset({"upstream", "model", "reason"})),
    # In the contract's table; samples only on a route with hedge_after_ms (test_hedge.py).
    "sidecar_hedges_total": ("counter", frozenset({"route", "result"})),
    # In the contract's table; samples only once an operator overrode a breaker
    # (tests/e2e/test_overrides.py).
    "sidecar_breaker_overrides_total": ("counter", frozenset({"upstream", "model", "action"})),
    # An addition to the contract (docs/overrides.md): 1 while an override is in force.
    "sidecar_breaker_override_active": ("gauge", frozenset({"upstream", "model", "action"})),
}
"""Metrics beyond the table (documented in docs/metrics.md)."""

LABEL_VALUES: dict[tuple[str, str], frozenset[str]] = {
    ("sidecar_upstream_attempts_total", "outcome"): frozenset(
        {
            "success",
            "http_4xx",
            "http_429",
            "http_5xx",
            "connect_error",
            "timeout",
            "stream_error",
            "cancelled",
            "empty",
            "sse_error",
            "empty_turn",
        }
    ),
    ("sidecar_fallbacks_total", "reason"): frozenset(
        {"circuit_open", "ramp", "failure", "context_window", "empty_turn", "budget"}
    ),
    ("sidecar_retries_skipped_total", "reason"): frozenset({"budget", "client_retry"}),
    ("sidecar_hedges_total", "result"): frozenset({"won", "lost", "not_sent"}),
    ("sidecar_stream_aborts_total", "reason"): frozenset(
        {"upstream_cut", "idle_timeout", "client_left", "drain"}
    ),
    ("sidecar_tokens_total", "kind"): frozenset({"input", "output", "cache_read", "cache_write"}),
    ("sidecar_tokens_total", "relayed"): frozenset({"true", "false"}),
    ("sidecar_breaker_state", "state"): frozenset({"closed", "open", "half_open"}),
    ("sidecar_breaker_overrides_total", "action"): frozenset(
        {"force_open", "force_closed", "auto"}
    ),
    ("sidecar_breaker_override_active", "action"): frozenset({"force_open", "force_closed"}),
    ("sidecar_breaker_transitions_total", "to"): frozenset({"closed", "open", "half_open"}),
}

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

CHAT = "/v1/chat/completions"
Http = aiohttp.ClientSession


# -- scraping ---------------------------------------------------------------------


class Scrape:
    """One ``/metrics`` body, parsed."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: list[tuple[str, dict[str, str], float]] = []
        self.types: dict[str, str] = {}
        self.helps: dict[str, str] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                name, kind = line[len("# TYPE ") :].split(" ", 1)
                self.types[name] = kind
            elif line.startswith("# HELP "):
                name, _, help_ = line[len("# HELP ") :].partition(" ")
                self.helps[name] = help_
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.append((s.name, dict(s.labels), float(s.value)))

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels`` (0.0 if none)."""
        return sum(
            v
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == want for k, want in labels.items())
        )

    def series(self) -> set[tuple[str, frozenset[tuple[str, str]]]]:
        """Every series (name and label set) in the scrape."""
        return {(n, frozenset(lab.items())) for n, lab, _ in self.samples}

    def labelsets(self, name: str) -> list[dict[str, str]]:
        """The label sets of the samples named ``name``."""
        return [lab for n, lab, _ in self.samples if n == name]


async def scrape(http: aiohttp.ClientSession, sc: Sidecar) -> Scrape:
    """Wait until no request is in flight in ``sc`` (so recording is done), then scrape."""
    await settle(sc)
    async with http.get(sc.admin_url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return Scrape(await r.text())


async def settle(sc: Sidecar, turns: int = 1000) -> None:
    """Let handlers that already sent their answer run their last lines (bounded loop turns).

    ``rt.inflight`` drops in the same synchronous ``finally`` that records the
    request's metrics, so once it is 0 every finished request is counted.
    """
    rt = sc.runtime
    assert rt is not None
    for _ in range(turns):
        if rt.inflight == 0:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{rt.inflight} request(s) still in flight")


class Delta:
    """``after - before`` for any sample (sums over unnamed labels)."""

    def __init__(self, before: Scrape, after: Scrape) -> None:
        self.before, self.after = before, after

    def __call__(self, name: str, **labels: str) -> float:
        return self.after.value(name, **labels) - self.before.value(name, **labels)


async def measure(http: aiohttp.ClientSession, sc: Sidecar, before: Scrape) -> Delta:
    """The changes since ``before``."""
    return Delta(before, await scrape(http, sc))


# -- config and calls -------------------------------------------------------------


def upstream(
    name: str,
    url: str,
    *,
    retries: int = 0,
    breaker: Mapping[str, Any] | None = None,
    **keys: Any,
) -> dict[str, dict[str, Any]]:
    """``{name: table}``: upstream ``name`` with ``retries`` retries (1 ms backoff on the
    FakeClock), ``breaker`` as its ``circuit_breaker`` and ``keys``."""
    retry = {"max_retries": retries, "backoff_initial_ms": 1, "backoff_max_ms": 1}
    return {name: configs.upstream(url, retry=retry, circuit_breaker=breaker, **keys)}


def route(
    name: str, candidates: Iterable[str | tuple[str, str]], *, prefix: str = "/v1/", **keys: Any
) -> dict[str, Any]:
    """One ``[[routes]]`` entry; a candidate is an upstream name or (upstream, model)."""
    cands = [c if isinstance(c, str) else {"upstream": c[0], "model": c[1]} for c in candidates]
    return configs.route(name, *cands, path_prefix=prefix, **keys)


def breaker(threshold: int = 1, cooldown_ms: int = 10_000) -> dict[str, int]:
    return {"failure_threshold": threshold, "cooldown_ms": cooldown_ms}


def dead_url() -> str:
    return f"http://127.0.0.1:{closed_port()}"


async def call(
    http: aiohttp.ClientSession,
    sc: Sidecar,
    path: str = CHAT,
    *,
    fault: Mapping[str, Any] | None = None,
    model: str = "gpt-4o",
) -> tuple[int, CIMultiDictProxy[str]]:
    """POST a chat request through the proxy; (status, headers), body read."""
    headers = {FAULT_HEADER: json.dumps(fault)} if fault else {}
    async with asyncio.timeout(WAIT_S):
        async with http.post(
            sc.proxy_url + path, json={"model": model, "messages": []}, headers=headers
        ) as r:
            await r.read()
            return r.status, r.headers


def attempts_header(headers: CIMultiDictProxy[str]) -> int:
    return int(headers["x-sidecar-attempts"])


# -- the contract's table -----------------------------------------------------------


async def test_names_types_labels_and_help_are_the_contracts(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: Http,
    clock: FakeClock,
) -> None:
    """After traffic that gives every family samples, each is exactly as the table says."""
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("nt_a", fake.url, retries=1, breaker=breaker(1))
            | upstream("nt_b", fake2.url, breaker={**breaker(5), "slow_call_ms": 100}),
            routes=[route("nt_chat", ["nt_a", "nt_b"])],
        )
    )
    fake.script([Fault(status=503), Fault(status=503)])
    assert (await call(http, sc))[0] == 200  # retry, failure, fallback, breaker opens
    assert (await call(http, sc))[0] == 200  # rejected, circuit_open fallback
    gate = asyncio.Event()
    fake2.script([Fault(hold_first_chunk=gate)])
    slow = asyncio.ensure_future(call(http, sc))
    async with asyncio.timeout(WAIT_S):
        await fake2.wait_for_requests(3)
    clock.advance(0.2)  # a slow success: sidecar_slow_calls_total
    gate.set()
    assert (await slow)[0] == 200
    s = await scrape(http, sc)

    families = {n for n in s.types if n.startswith("sidecar_")}
    assert families == set(CONTRACT) | set(EXTRA)
    for name, (kind, labels) in {**CONTRACT, **EXTRA}.items():
        assert s.types[name] == kind, name
        assert s.helps[name].strip(), f"{name} has no HELP"
        if name in EXTRA:
            continue
        sample_names = (
            [f"{name}_bucket", f"{name}_count", f"{name}_sum"] if kind == "histogram" else [name]
        )
        for sample_name in sample_names:
            sets = s.labelsets(sample_name)
            assert sets, f"no samples of {sample_name}"
            for lab in sets:
                keys = set(lab) - ({"le"} if sample_name.endswith("_bucket") else set())
                assert keys == labels, (sample_name, lab)
    for (name, label), allowed in LABEL_VALUES.items():
        seen = {lab[label] for lab in s.labelsets(name)}
        assert seen <= allowed, (name, label, seen - allowed)
        # Every series but the cut streams', the skipped retries', the hedges' and the
        # operators' overrides' shows up in this scenario (the fake's JSON answers report
        # usage); tests/e2e/test_turn_*.py, test_retry_budget.py, test_hedge.py and
        # test_overrides.py drive the rest.
        quiet = (
            "sidecar_stream_aborts_total",
            "sidecar_retries_skipped_total",
            "sidecar_hedges_total",
            "sidecar_breaker_overrides_total",
        )
        assert seen or name in quiet, (name, label)
    # counters end in _total, nothing else does; durations are in seconds
    for name, kind in s.types.items():
        assert name.endswith("_total") == (kind == "counter"), name
        if name.startswith("sidecar_") and kind == "histogram":
            assert name.endswith("_seconds"), name
    assert s.value("sidecar_inflight_requests") == 0


async def test_latency_buckets_span_llm_latencies(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(
        configs.config(upstreams=upstream("bk_a", fake.url), routes=[route("bk_chat", ["bk_a"])])
    )
    assert (await call(http, sc))[0] == 200
    s = await scrape(http, sc)
    for name, labels in (
        ("sidecar_request_duration_seconds_bucket", {"route": "bk_chat"}),
        ("sidecar_upstream_first_byte_seconds_bucket", {"upstream": "bk_a", "model": "*"}),
    ):
        les = [
            float(lab["le"])
            for lab in s.labelsets(name)
            if all(lab.get(k) == v for k, v in labels.items())
        ]
        assert les == [*BUCKETS, math.inf], name
        assert les[0] <= 0.005 and les[-2] >= 120.0


# -- the one-hot breaker state --------------------------------------------------------


async def test_breaker_state_series_exist_for_every_target_from_start(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """Every configured target with a breaker: closed=1, open=0, half_open=0, before any request."""
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("st_a", fake.url, breaker=breaker())
            | upstream("st_b", fake.url, breaker=breaker())
            | upstream("st_nobrk", fake.url),
            routes=[
                route("st_one", [("st_a", "gpt-4o"), "st_a", "st_nobrk"], prefix="/one/"),
                route("st_two", [("st_b", "claude-x"), ("st_a", "gpt-4o")], prefix="/two/"),
            ],
        )
    )
    s = await scrape(http, sc)
    targets = {("st_a", "gpt-4o"), ("st_a", "*"), ("st_b", "claude-x")}
    seen = {
        (lab["upstream"], lab["model"])
        for lab in s.labelsets("sidecar_breaker_state")
        if lab["upstream"].startswith("st_")
    }
    assert seen == targets  # st_nobrk has no breaker, so no state series
    for up, model in targets:
        for state, want in (("closed", 1.0), ("open", 0.0), ("half_open", 0.0)):
            got = s.value("sidecar_breaker_state", upstream=up, model=model, state=state)
            assert got == want, (up, model, state)
        assert (
            len(
                [
                    lab
                    for lab in s.labelsets("sidecar_breaker_state")
                    if (lab["upstream"], lab["model"]) == (up, model)
                ]
            )
            == 3
        )
    assert set(await status(http, sc)) == {f"{u}/{m}" for u, m in targets}


# -- cardinality: label values come from config names only ------------------------------


async def test_request_content_creates_no_series(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """1,000 requests with distinct random models (and paths) add no series."""
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("cd_a", fake.url, breaker=breaker(threshold=10_000)),
            routes=[
                route("cd_free", ["cd_a"], prefix="/v1/"),
                route("cd_rewrite", [("cd_a", "gpt-4o-mini")], prefix="/rw/"),
                route("cd_picky", ["cd_a"], prefix="/picky/", models=["smart"]),
            ],
        )
    )
    rnd = random.Random(20260101)

    def word() -> str:
        return "".join(rnd.choices(string.ascii_letters + string.digits + "-_./", k=24))

    kinds = [
        ("/v1/chat/completions", 200),  # model passes through untouched
        ("/rw/chat/completions", 200),  # model rewritten to the candidate's
        ("/picky/chat/completions", 404),  # models route: an unknown model is no route
        ("/nowhere/", 404),  # no route
    ]
    for path, want in kinds:  # warm-up: each kind's series exist before counting
        assert (await call(http, sc, path, model=word()))[0] == want
    before = await scrape(http, sc)

    models = [word() for _ in range(1000)]
    sem = asyncio.Semaphore(32)

    async def one(i: int, model: str) -> int:
        path, _ = kinds[i % len(kinds)]
        if path == "/nowhere/":
            path += model  # a random path too
        async with sem:
            return (await call(http, sc, path, model=model))[0]

    got = await asyncio.gather(*(one(i, m) for i, m in enumerate(models)))
    assert got == [kinds[i % len(kinds)][1] for i in range(len(models))]
    after = await scrape(http, sc)

    assert after.series() == before.series()
    assert len(after.samples) == len(before.samples)
    assert Delta(before, after)("sidecar_requests_total") == 1000
    assert not [m for m in models if m in after.text]


# -- counters, exact ------------------------------------------------------------------------


async def test_success_counts_request_attempt_and_latencies(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("ok_a", fake.url, retries=2, breaker=breaker()),
            routes=[route("ok_chat", [("ok_a", "gpt-4o")])],
        )
    )
    before = await scrape(http, sc)
    for _ in range(3):
        assert (await call(http, sc))[0] == 200
    d = await measure(http, sc, before)
    assert d("sidecar_requests_total", route="ok_chat", code="200") == 3
    assert d("sidecar_requests_total", route="ok_chat") == 3
    assert d("sidecar_request_duration_seconds_count", route="ok_chat") == 3
    assert d("sidecar_request_duration_seconds_bucket", route="ok_chat", le="+Inf") == 3
    att = {"upstream": "ok_a", "model": "gpt-4o"}
    assert d("sidecar_upstream_attempts_total", outcome="success", **att) == 3
    assert d("sidecar_upstream_attempts_total", **att) == 3
    assert d("sidecar_upstream_first_byte_seconds_count", **att) == 3
    # the FakeClock does not move during an attempt: first byte after 0 s, first bucket
    assert d("sidecar_upstream_first_byte_seconds_bucket", le="0.005", **att) == 3
    assert d("sidecar_upstream_first_byte_seconds_sum", **att) == 0
    assert d("sidecar_retries_total", **att) == 0
    assert d("sidecar_fallbacks_total", route="ok_chat") == 0
    assert d("sidecar_breaker_transitions_total", upstream="ok_a") == 0
    assert d("sidecar_breaker_rejections_total", upstream="ok_a") == 0


async def test_retry_on_same_candidate(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("rt_a", fake.url, retries=2) | upstream("rt_b", fake2.url),
            routes=[route("rt_chat", ["rt_a", "rt_b"])],
        )
    )
    fake.script([Fault(status=503), Fault(status=429)])
    before = await scrape(http, sc)
    code, headers = await call(http, sc)
    assert code == 200 and attempts_header(headers) == 3
    d = await measure(http, sc, before)
    assert d("sidecar_retries_total", upstream="rt_a", model="*") == 2
    assert d("sidecar_upstream_attempts_total", upstream="rt_a", outcome="http_5xx") == 1
    assert d("sidecar_upstream_attempts_total", upstream="rt_a", outcome="http_429") == 1
    assert d("sidecar_upstream_attempts_total", upstream="rt_a", outcome="success") == 1
    assert d("sidecar_upstream_attempts_total", upstream="rt_b") == 0
    assert d("sidecar_fallbacks_total", route="rt_chat") == 0
    assert d("sidecar_requests_total", route="rt_chat", code="200") == 1


async def test_fallback_failure_breaker_opens_then_rejects(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """Two failed calls (each after one retry) open the breaker; the next call skips it."""
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("fo_a", fake.url, retries=1, breaker=breaker(threshold=2))
            | upstream("fo_b", fake2.url),
            routes=[route("fo_chat", [("fo_a", "gpt-4o"), "fo_b"])],
        )
    )
    fake.set_default(Fault(status=503))
    a = {"upstream": "fo_a", "model": "gpt-4o"}

    before = await scrape(http, sc)
    code, headers = await call(http, sc)
    assert code == 200 and attempts_header(headers) == 3
    d = await measure(http, sc, before)
    assert d("sidecar_upstream_attempts_total", outcome="http_5xx", **a) == 2
    assert d("sidecar_retries_total", **a) == 1
    assert d("sidecar_fallbacks_total", route="fo_chat", upstream="fo_a", reason="failure") == 1
    assert d("sidecar_fallbacks_total", route="fo_chat", reason="circuit_open") == 0
    assert d("sidecar_upstream_attempts_total", upstream="fo_b", outcome="success") == 1
    assert d("sidecar_breaker_transitions_total", **a) == 0  # 1 failure of 2
    assert d.after.value("sidecar_breaker_state", state="closed", **a) == 1

    before = d.after
    assert (await call(http, sc))[0] == 200
    d = await measure(http, sc, before)
    assert d("sidecar_fallbacks_total", route="fo_chat", upstream="fo_a", reason="failure") == 1
    assert d("sidecar_breaker_transitions_total", to="open", **a) == 1
    assert d("sidecar_breaker_transitions_total", **a) == 1
    for state, want in (("open", 1), ("closed", 0), ("half_open", 0)):
        assert d.after.value("sidecar_breaker_state", state=state, **a) == want

    before = d.after
    connections = fake.request_count
    code, headers = await call(http, sc)
    assert code == 200 and attempts_header(headers) == 1
    assert fake.request_count == connections
    d = await measure(http, sc, before)
    assert d("sidecar_breaker_rejections_total", **a) == 1
    assert (
        d("sidecar_fallbacks_total", route="fo_chat", upstream="fo_a", reason="circuit_open") == 1
    )
    assert d("sidecar_fallbacks_total", route="fo_chat", reason="failure") == 0
    assert d("sidecar_upstream_attempts_total", **a) == 0
    assert d("sidecar_retries_total", **a) == 0
    assert d("sidecar_breaker_transitions_total", **a) == 0
    assert d("sidecar_requests_total", route="fo_chat", code="200") == 1


async def test_probe_half_open_rejection_and_close(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """open -> half_open on the timer (counted once, no request needed); the probe holds
    the only slot (a second call is rejected); its success closes the breaker."""
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("pr_a", fake.url, breaker=breaker(threshold=1, cooldown_ms=30_000))
            | upstream("pr_b", fake2.url),
            routes=[route("pr_chat", ["pr_a", "pr_b"])],
        )
    )
    a = {"upstream": "pr_a", "model": "*"}
    fake.script([Fault(status=500)])
    assert (await call(http, sc))[0] == 200
    before = await scrape(http, sc)
    assert before.value("sidecar_breaker_state", state="open", **a) == 1

    clock.advance(29.999)
    d = await measure(http, sc, before)
    assert d("sidecar_breaker_transitions_total", **a) == 0
    clock.advance(0.001)  # the timer fires: half_open without any request
    d = await measure(http, sc, before)
    assert d("sidecar_breaker_transitions_total", to="half_open", **a) == 1
    assert d("sidecar_breaker_transitions_total", **a) == 1
    for state, want in (("half_open", 1), ("open", 0), ("closed", 0)):
        assert d.after.value("sidecar_breaker_state", state=state, **a) == want
    clock.advance(60)  # no second move
    d = await measure(http, sc, before)
    assert d("sidecar_breaker_transitions_total", **a) == 1

    before = d.after
    gate = asyncio.Event()
    fake.script([Fault(hold_first_chunk=gate)])
    probe = asyncio.create_task(call(http, sc))
    async with asyncio.timeout(WAIT_S):
        await fake.wait_for_requests(fake.request_count + 1)
    async with http.get(sc.admin_url + "/metrics") as r:
        assert Scrape(await r.text()).value("sidecar_inflight_requests") == 1
    code, headers = await call(http, sc)  # the slot is taken: skipped, served by pr_b
    assert code == 200 and attempts_header(headers) == 1
    gate.set()
    assert (await probe)[0] == 200
    d = await measure(http, sc, before)
    assert d("sidecar_breaker_rejections_total", **a) == 1
    assert (
        d("sidecar_fallbacks_total", route="pr_chat", upstream="pr_a", reason="circuit_open") == 1
    )
    assert d("sidecar_upstream_attempts_total", outcome="success", **a) == 1
    assert d("sidecar_breaker_transitions_total", to="closed", **a) == 1
    assert d("sidecar_breaker_transitions_total", **a) == 1
    for state, want in (("closed", 1), ("open", 0), ("half_open", 0)):
        assert d.after.value("sidecar_breaker_state", state=state, **a) == want
    assert d.after.value("sidecar_inflight_requests") == 0


async def test_failed_probe_reopens(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("rp_a", fake.url, breaker=breaker(threshold=1, cooldown_ms=1000))
            | upstream("rp_b", fake2.url),
            routes=[route("rp_chat", ["rp_a", "rp_b"])],
        )
    )
    a = {"upstream": "rp_a", "model": "*"}
    fake.set_default(Fault(status=503))
    before = await scrape(http, sc)
    assert (await call(http, sc))[0] == 200  # opens
    clock.advance(1.0)  # half_open
    assert (await call(http, sc))[0] == 200  # the probe fails: open again
    d = await measure(http, sc, before)
    assert d("sidecar_breaker_transitions_total", to="open", **a) == 2
    assert d("sidecar_breaker_transitions_total", to="half_open", **a) == 1
    assert d("sidecar_breaker_transitions_total", to="closed", **a) == 0
    assert d("sidecar_fallbacks_total", route="rp_chat", upstream="rp_a", reason="failure") == 2
    assert d("sidecar_breaker_rejections_total", **a) == 0
    assert d.after.value("sidecar_breaker_state", state="open", **a) == 1


async def test_every_candidate_open_is_503_with_rejections(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """All skipped: one rejection per candidate, a fallback only where there is a next one."""
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("ao_a", fake.url, breaker=breaker(1))
            | upstream("ao_b", fake2.url, breaker=breaker(1)),
            routes=[route("ao_chat", ["ao_a", "ao_b"])],
        )
    )
    fake.set_default(Fault(status=503))
    fake2.set_default(Fault(status=503))
    assert (await call(http, sc))[0] == 503  # both fail (the last answer is relayed); both open
    before = await scrape(http, sc)
    code, headers = await call(http, sc)
    assert code == 503 and attempts_header(headers) == 0
    assert headers["x-sidecar-error"] == "circuit_open"
    d = await measure(http, sc, before)
    assert d("sidecar_breaker_rejections_total", upstream="ao_a") == 1
    assert d("sidecar_breaker_rejections_total", upstream="ao_b") == 1
    assert (
        d("sidecar_fallbacks_total", route="ao_chat", upstream="ao_a", reason="circuit_open") == 1
    )
    assert d("sidecar_fallbacks_total", route="ao_chat", upstream="ao_b") == 0
    assert d("sidecar_upstream_attempts_total", upstream="ao_a") == 0
    assert d("sidecar_upstream_attempts_total", upstream="ao_b") == 0
    assert d("sidecar_requests_total", route="ao_chat", code="503") == 1
    assert d("sidecar_request_duration_seconds_count", route="ao_chat") == 1


# -- attempts by outcome ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "fault", "want_status", "outcome", "first_bytes"),
    [
        ("success", {}, 200, "success", 1),
        ("empty", {"empty_body": True}, 200, "empty", 0),
        ("http_4xx", {"status": 404}, 404, "http_4xx", 1),
        ("http_429", {"status": 429}, 429, "http_429", 0),
        ("http_5xx", {"status": 500}, 500, "http_5xx", 0),
        ("stream_error", {"reset_before_headers": True}, 502, "stream_error", 0),
        ("stream_error_after_headers", {"reset_after_headers": True}, 502, "stream_error", 0),
        ("timeout", {"stall": True}, 504, "timeout", 0),
    ],
)
async def test_attempt_outcome(
    case: str,
    fault: dict[str, Any],
    want_status: int,
    outcome: str,
    first_bytes: int,
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """One request, one attempt (no retries), classified; the client sees what the table says."""
    up, rname = f"oc_{case}", f"oc_{case}_route"
    # A short first-byte timeout only where it is the point (elsewhere it could flake).
    extra: dict[str, Any] = {"first_byte_timeout_ms": 50} if outcome == "timeout" else {}
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream(up, fake.url, **extra), routes=[route(rname, [(up, "gpt-4o")])]
        )
    )
    before = await scrape(http, sc)
    steps = [(1, 0.05)] if outcome == "timeout" else []  # the first-byte timeout, on fake time
    code, headers = await on_fake_time(clock, fake, steps, call(http, sc, fault=fault))
    assert code == want_status
    assert attempts_header(headers) == 1
    fake.release()  # the stalled answer (timeout case) may end now
    d = await measure(http, sc, before)
    a = {"upstream": up, "model": "gpt-4o"}
    assert d("sidecar_upstream_attempts_total", outcome=outcome, **a) == 1
    assert d("sidecar_upstream_attempts_total", **a) == 1
    assert d("sidecar_upstream_first_byte_seconds_count", **a) == first_bytes
    assert d("sidecar_requests_total", route=rname, code=str(want_status)) == 1
    assert d("sidecar_requests_total", route=rname) == 1
    assert d("sidecar_request_duration_seconds_count", route=rname) == 1
    assert d("sidecar_retries_total", **a) == 0


async def test_connect_error_outcome_with_retries(
    start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("ce_a", dead_url(), retries=2), routes=[route("ce_chat", ["ce_a"])]
        )
    )
    before = await scrape(http, sc)
    code, headers = await call(http, sc)
    assert code == 502 and attempts_header(headers) == 3
    d = await measure(http, sc, before)
    assert d("sidecar_upstream_attempts_total", upstream="ce_a", outcome="connect_error") == 3
    assert d("sidecar_upstream_attempts_total", upstream="ce_a") == 3
    assert d("sidecar_retries_total", upstream="ce_a") == 2
    assert d("sidecar_requests_total", route="ce_chat", code="502") == 1


async def test_client_disconnect_is_a_cancelled_attempt_and_inflight_returns_to_zero(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(
        configs.config(
            upstreams=upstream("cx_a", fake.url, breaker=breaker(1)),
            routes=[route("cx_chat", ["cx_a"])],
        )
    )
    gate = asyncio.Event()
    fake.set_default(Fault(hold_first_chunk=gate))
    before = await scrape(http, sc)
    assert before.value("sidecar_inflight_requests") == 0
    async with aiohttp.ClientSession() as client:
        task = asyncio.create_task(call(client, sc))
        async with asyncio.timeout(WAIT_S):
            await fake.wait_for_requests(1)
        async with http.get(sc.admin_url + "/metrics") as r:
            assert Scrape(await r.text()).value("sidecar_inflight_requests") == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    async with asyncio.timeout(WAIT_S):
        await fake.wait_until(lambda: fake.active_requests == 0)
    gate.set()
    d = await measure(http, sc, before)
    a = {"upstream": "cx_a", "model": "*"}
    assert d("sidecar_upstream_attempts_total", outcome="cancelled", **a) == 1
    assert d("sidecar_upstream_attempts_total", **a) == 1
    assert d.after.value("sidecar_inflight_requests") == 0
    assert d("sidecar_requests_total") == 1  # counted once, whatever the label
    # neutral for the breaker: still closed, nothing counted
    assert d("sidecar_breaker_transitions_total", **a) == 0
    assert d.after.value("sidecar_breaker_state", state="closed", **a) == 1


async def test_deadline_cuts_an_attempt_cancelled(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession, clock: FakeClock
) -> None:
    """``request_timeout_ms`` runs out while waiting: 504; the cut attempt is counted."""
    sc = await start_sidecar(
        configs.config(
            server={"request_timeout_ms": 200},
            upstreams=upstream("dl_a", fake.url),
            routes=[route("dl_chat", ["dl_a"])],
        )
    )
    before = await scrape(http, sc)
    answer = call(http, sc, fault={"stall": True})
    code, headers = await on_fake_time(clock, fake, [(1, 0.2)], answer)
    fake.release()
    assert code == 504 and attempts_header(headers) == 1
    d = await measure(http, sc, before)
    assert d("sidecar_upstream_attempts_total", upstream="dl_a", outcome="cancelled") == 1
    assert d("sidecar_upstream_attempts_total", upstream="dl_a") == 1
    assert d("sidecar_requests_total", route="dl_chat", code="504") == 1


# -- the sidecar's own answers ---------------------------------------------------------------


async def test_own_errors_are_counted_by_code(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """No route (404), a body no models route can take (400), too large (413): route ""."""
    sc = await start_sidecar(
        configs.config(
            server={"max_request_body_bytes": 1000},
            upstreams=upstream("oe_a", fake.url),
            routes=[route("oe_picky", ["oe_a"], prefix="/oe/", models=["smart"])],
        )
    )
    before = await scrape(http, sc)
    assert (await call(http, sc, "/elsewhere"))[0] == 404
    async with http.post(sc.proxy_url + "/oe/x", data=b"not json") as r:
        assert r.status == 400
    async with http.post(sc.proxy_url + "/oe/x", data=b"x" * 2000) as r:
        assert r.status == 413
    d = await measure(http, sc, before)
    assert d("sidecar_requests_total", route="", code="404") == 1
    assert d("sidecar_requests_total", route="", code="400") == 1
    assert d("sidecar_requests_total", route="", code="413") == 1
    assert d("sidecar_requests_total") == 3
    assert d("sidecar_request_duration_seconds_count", route="") == 3
    assert d("sidecar_upstream_attempts_total") == 0
    assert fake.request_count == 0

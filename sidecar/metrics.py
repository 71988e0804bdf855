"""Every Prometheus metric, declared once, and the recorder the proxy calls.

Names, types and labels follow the contract's "Metrics" table. Label values
come from config names only (route, upstream, candidate model or ``*``), never
from request content, so a request cannot create a series. Recording never
decides anything and never raises into a request.

Exposition is prometheus-client's (served by prometheus-async's aiohttp
handler on the admin port), registered in the default registry. The four
series every request moves are plain counts (:mod:`sidecar.metric_counts`)
that a collector in that registry turns into the same families at scrape time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import REGISTRY, Counter, Gauge, disable_created_metrics

from sidecar.breakers.machine import State, Target
from sidecar.metric_counts import CounterCounts, CountsCollector, HistogramCounts
from sidecar.usage import KINDS, Usage

# `_created` samples add a series per child and help no dashboard here.
disable_created_metrics()  # type: ignore[no-untyped-call]

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Seconds: LLM calls range from a few ms (cached, embeddings) to minutes (long generations)."""

# The four families every request moves: plain counts, served at scrape time
# (sidecar.metric_counts); the others are prometheus-client's own metrics.
REQUESTS = CounterCounts(
    "sidecar_requests_total", "Requests answered, by route and status", ["route", "code"]
)
REQUEST_DURATION = HistogramCounts(
    "sidecar_request_duration_seconds",
    "Time from request received to response complete",
    ["route"],
    LATENCY_BUCKETS,
)
ATTEMPTS = CounterCounts(
    "sidecar_upstream_attempts_total",
    "Upstream HTTP attempts by outcome",
    ["upstream", "model", "outcome"],
)
FIRST_BYTE = HistogramCounts(
    "sidecar_upstream_first_byte_seconds",
    "Upstream request sent to first response body chunk",
    ["upstream", "model"],
    LATENCY_BUCKETS,
)
TOKENS = CounterCounts(
    "sidecar_tokens_total",
    "Tokens the providers reported per answer; relayed=false for answers the client never got",
    ["route", "upstream", "model", "kind", "relayed"],
)
"""Moved by most requests (every answer that reports usage): plain counts as well."""
REGISTRY.register(CountsCollector([REQUESTS, REQUEST_DURATION, ATTEMPTS, FIRST_BYTE, TOKENS]))
RETRIES = Counter(
    "sidecar_retries_total", "Retries sent on the same candidate", ["upstream", "model"]
)
RETRIES_SKIPPED = Counter(
    "sidecar_retries_skipped_total",
    "Retries not made: the upstream's retry budget was spent (budget), or the request "
    "was itself a client's retry (client_retry)",
    ["upstream", "model", "reason"],
)
FALLBACKS = Counter(
    "sidecar_fallbacks_total",
    "Moves to the next candidate, by the upstream left and why",
    ["route", "upstream", "reason"],
)
HEDGES = Counter(
    "sidecar_hedges_total",
    "Hedged first tokens (route hedge_after_ms) by result: won (the hedge's answer was "
    "relayed), lost, not_sent (no candidate or no retry budget left for it)",
    ["route", "result"],
)
AFFINITY = Counter(
    "sidecar_affinity_total",
    "Requests of a session (affinity_header): placed, kept on its member, or moved",
    ["route", "result"],
)
BREAKER_STATE = Gauge(
    "sidecar_breaker_state", "Circuit breaker state, one-hot", ["upstream", "model", "state"]
)
BREAKER_TRANSITIONS = Counter(
    "sidecar_breaker_transitions_total", "Circuit breaker transitions", ["upstream", "model", "to"]
)
BREAKER_REJECTIONS = Counter(
    "sidecar_breaker_rejections_total",
    "Calls skipped because the breaker was open or half-open and full",
    ["upstream", "model"],
)
RAMP_SKIPS = Counter(
    "sidecar_ramp_skips_total",
    "Calls a recovering target skipped during its ramp (circuit_breaker.ramp_ms)",
    ["upstream", "model"],
)
SLOW_CALLS = Counter(
    "sidecar_slow_calls_total",
    "Successes counted as breaker failures by circuit_breaker.slow_call_ms",
    ["upstream", "model"],
)
STREAM_ABORTS = Counter(
    "sidecar_stream_aborts_total",
    "Answers cut after the commit point, by why (counted as successes at their commit point)",
    ["upstream", "model", "reason"],
)
INFLIGHT = Gauge("sidecar_inflight_requests", "Requests being handled by the proxy")
OVERRIDES = Counter(
    "sidecar_breaker_overrides_total",
    "Operators' overrides taken by this sidecar's admin port (POST /breakers/...), by action",
    ["upstream", "model", "action"],
)
OVERRIDE_ACTIVE = Gauge(
    "sidecar_breaker_override_active",
    "1 while an operator's override (force_open, force_closed) is in force on the target here",
    ["upstream", "model", "action"],
)
OVERRIDE_GAUGE_ACTIONS = ("force_open", "force_closed")
"""The ``action`` values of :data:`OVERRIDE_ACTIVE` (``auto`` is none in force)."""


class _InFlight:
    """The in-flight count, read by :data:`INFLIGHT` at scrape time (``set_function``):
    two plain integer updates per request instead of two locked gauge updates."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def value(self) -> float:
        return float(self.n)


_IN_FLIGHT = _InFlight()
INFLIGHT.set_function(_IN_FLIGHT.value)
CONFIG_RELOADS = Counter("sidecar_config_reloads_total", "Config reloads by result", ["result"])
# The fleet's metrics exist only with [fleet]: registered by register_fleet().
FLEET_STORE_UP = Gauge(
    "sidecar_fleet_store_up", "1 while the fleet's store answers, 0 when not", registry=None
)
FLEET_SYNCS = Counter(
    "sidecar_fleet_syncs_total", "Reads of the fleet's state, by result", ["result"], registry=None
)

# The tracing counter exists only with [tracing]: registered by register_tracing().
TRACE_SPANS_DROPPED = Counter(
    "sidecar_trace_spans_dropped_total",
    "Spans lost before reaching the collector: the export queue was full, or their export failed",
    registry=None,
)


_fleet_users = 0


def register_fleet() -> None:
    """Expose the fleet's metrics while a fleet runs (only with ``[fleet]``); counted, so
    :func:`unregister_fleet` removes them when the last one stops."""
    global _fleet_users
    _fleet_users += 1
    if _fleet_users == 1:
        REGISTRY.register(FLEET_STORE_UP)
        REGISTRY.register(FLEET_SYNCS)


def unregister_fleet() -> None:
    """The counterpart of :func:`register_fleet`."""
    global _fleet_users
    _fleet_users -= 1
    if _fleet_users == 0:
        REGISTRY.unregister(FLEET_STORE_UP)
        REGISTRY.unregister(FLEET_SYNCS)


_tracing_users = 0


def register_tracing() -> None:
    """Expose ``sidecar_trace_spans_dropped_total`` while tracing runs (only with
    ``[tracing]``); counted, as :func:`register_fleet` is."""
    global _tracing_users
    _tracing_users += 1
    if _tracing_users == 1:
        REGISTRY.register(TRACE_SPANS_DROPPED)


def unregister_tracing() -> None:
    """The counterpart of :func:`register_tracing`."""
    global _tracing_users
    _tracing_users -= 1
    if _tracing_users == 0:
        REGISTRY.unregister(TRACE_SPANS_DROPPED)


def trace_spans_dropped(n: int) -> None:
    """``n`` spans were lost (any thread: prometheus-client's counters are thread-safe)."""
    TRACE_SPANS_DROPPED.inc(n)


class Recorder:
    """What the proxy reports, one method per event; metrics listen, they never decide.

    Label children (and the plain count cells of :mod:`sidecar.metric_counts`) are
    looked up once and cached (``.labels(...)`` takes a lock and builds a key on
    every call): label values come from config names only, so the caches are
    bounded by the config. Children are created on first use, so a series appears
    in ``/metrics`` only once something happened to it.
    """

    __slots__ = (
        "_attempts", "_durations", "_fallbacks", "_first_byte", "_requests", "_retries", "_tokens",
    )  # fmt: skip

    def __init__(self) -> None:
        self._requests: dict[tuple[str, int], list[float]] = {}
        self._durations: dict[str, list[float]] = {}
        self._attempts: dict[tuple[Target, str], list[float]] = {}
        self._first_byte: dict[Target, list[float]] = {}
        self._retries: dict[Target, Counter] = {}
        self._fallbacks: dict[tuple[str, str, str], Counter] = {}
        self._tokens: dict[tuple[str, Target, bool], list[list[float] | None]] = {}

    def request_started(self) -> None:
        """A request entered the proxy handler (``sidecar_inflight_requests``)."""
        _IN_FLIGHT.n += 1

    def request_ended(self, route: str, status: int, seconds: float) -> None:
        """A request that :meth:`request_started` ended with ``status`` after ``seconds``."""
        _IN_FLIGHT.n -= 1
        self.answered(route, status)
        duration = self._durations.get(route)
        if duration is None:
            duration = self._durations[route] = REQUEST_DURATION.cell(route)
        REQUEST_DURATION.observe(duration, seconds)

    def answered(self, route: str, status: int) -> None:
        """``sidecar_requests_total`` for a request answered with ``status`` ("" = no route)."""
        key = (route, status)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = REQUESTS.cell(route, str(status))
        counter[0] += 1

    def attempt(self, target: Target, outcome: str, first_byte_s: float | None) -> None:
        """One upstream attempt ended in ``outcome``; its first byte came after ``first_byte_s``."""
        key = (target, outcome)
        counter = self._attempts.get(key)
        if counter is None:
            counter = self._attempts[key] = ATTEMPTS.cell(target.upstream, target.model, outcome)
        counter[0] += 1
        if first_byte_s is not None:
            hist = self._first_byte.get(target)
            if hist is None:
                hist = self._first_byte[target] = FIRST_BYTE.cell(*target)
            FIRST_BYTE.observe(hist, first_byte_s)

    def retry(self, target: Target) -> None:
        """A retry is about to be sent to ``target``."""
        counter = self._retries.get(target)
        if counter is None:
            counter = self._retries[target] = RETRIES.labels(*target)
        counter.inc()

    def retry_skipped(self, target: Target, reason: str) -> None:
        """``sidecar_retries_skipped_total``: a retry on ``target`` was due and not made;
        ``reason``: ``budget`` (the upstream's retry budget, :mod:`sidecar.retry_budget`)
        or ``client_retry`` (the request is an SDK's retry: ``x-stainless-retry-count``)."""
        RETRIES_SKIPPED.labels(target.upstream, target.model, reason).inc()

    def hedge(self, route: str, result: str) -> None:
        """``sidecar_hedges_total``: a request on ``route`` whose hedge was due ended with
        ``result``: ``won``, ``lost`` or ``not_sent`` (:mod:`sidecar.hedge`)."""
        HEDGES.labels(route, result).inc()

    def affinity(self, route: str, result: str) -> None:
        """A request of a session on ``route``: ``new``, ``kept`` or ``moved``."""
        AFFINITY.labels(route, result).inc()

    def slow_call(self, target: Target) -> None:
        """A success of ``target`` took longer than ``slow_call_ms`` to its first output."""
        SLOW_CALLS.labels(*target).inc()

    def tokens(self, route: str, target: Target, usage: Usage, relayed: bool) -> None:
        """``sidecar_tokens_total``: the tokens ``usage`` reported for one answer of
        ``target`` on ``route``; ``relayed``: the client got that answer. A kind that
        was not reported is not counted and makes no series (its cell is made on the
        kind's first count)."""
        key = (route, target, relayed)
        cells = self._tokens.get(key)
        if cells is None:
            cells = self._tokens[key] = [None, None, None, None]
        for i, n in enumerate((usage.input, usage.output, usage.cache_read, usage.cache_write)):
            if n is not None:
                cell = cells[i]
                if cell is None:
                    flag = "true" if relayed else "false"
                    cell = cells[i] = TOKENS.cell(
                        route, target.upstream, target.model, KINDS[i], flag
                    )
                cell[0] += n

    def stream_aborted(self, target: Target, reason: str) -> None:
        """``sidecar_stream_aborts_total``: a committed answer of ``target`` was cut;
        ``reason``: ``upstream_cut``, ``idle_timeout``, ``client_left`` or ``drain``."""
        STREAM_ABORTS.labels(target.upstream, target.model, reason).inc()

    def fallback(self, route: str, upstream: str, reason: str) -> None:
        """The route moves on from ``upstream`` to its next candidate; ``reason``:
        ``circuit_open``, ``ramp``, ``failure``, ``context_window``, ``empty_turn`` or
        ``budget`` (a retry the retry budget did not allow)."""
        key = (route, upstream, reason)
        counter = self._fallbacks.get(key)
        if counter is None:
            counter = self._fallbacks[key] = FALLBACKS.labels(*key)
        counter.inc()


def set_breaker_state(target: Target, state: State) -> None:
    """Set the one-hot state gauge of ``target`` (all three series)."""
    for s in State:
        BREAKER_STATE.labels(target.upstream, target.model, s.value).set(1 if s is state else 0)


def init_breakers(targets: Iterable[tuple[Target, State]]) -> None:
    """Create the state series for every configured target (dashboards see them at once)."""
    for target, state in targets:
        set_breaker_state(target, state)


def forget_breakers(targets: Iterable[Target]) -> None:
    """Remove the state series of targets that no longer exist (after a config reload)."""
    for target in targets:
        for s in State:
            with contextlib.suppress(KeyError):
                BREAKER_STATE.remove(target.upstream, target.model, s.value)
        for action in OVERRIDE_GAUGE_ACTIONS:
            with contextlib.suppress(KeyError):
                OVERRIDE_ACTIVE.remove(target.upstream, target.model, action)


def set_override_active(target: Target, action: object) -> None:
    """Set ``sidecar_breaker_override_active`` of ``target``: 1 for ``action`` (the
    override in force: ``force_open`` or ``force_closed``), 0 for the other; None: both 0."""
    for a in OVERRIDE_GAUGE_ACTIONS:
        OVERRIDE_ACTIVE.labels(target.upstream, target.model, a).set(1 if a == action else 0)


def init_overrides(targets: Iterable[tuple[Target, object]]) -> None:
    """Create the override series of every target with a breaker (0, or 1 for the action
    of an override it holds: ``(target, override or None)``), as :func:`init_breakers`."""
    for target, ov in targets:
        set_override_active(target, getattr(ov, "action", None))

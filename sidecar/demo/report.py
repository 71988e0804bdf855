"""The demo's text: the intro, one table row per second, and the summary.

Numbers come from where an operator would read them: the app's own view (status,
``x-sidecar-upstream``, ``x-sidecar-attempts``, latency), the fake providers'
request counters (calls that really reached the primary), and the sidecar's
admin port (``/status?all=1`` for the state, ``/metrics`` for openings and
rejections).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sidecar.demo.show import Screen, Story, fmt_ms, seconds_until, state_text
from sidecar.demo.traffic import Result, percentile
from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream, Fault

__all__ = ["Phase", "Report", "intro", "scrape", "table_header", "table_row"]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
PRIMARIES = ("primary", "twin_primary")


@dataclass(frozen=True)
class Phase:
    """From ``at`` seconds on, both primaries answer with ``fault``."""

    at: float
    name: str
    label: str
    fault: Fault = field(compare=False)
    note: str


async def scrape(session: aiohttp.ClientSession, admin_url: str) -> Samples:
    """Every sample of the sidecar's ``/metrics`` (empty if it cannot be read)."""
    try:
        async with session.get(admin_url + "/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return {}
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _metric(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def intro(
    screen: Screen,
    fakes: Mapping[str, FakeUpstream],
    sidecar: Sidecar,
    script: Sequence[Phase],
    seconds: float,
    rate: float,
    settings: Mapping[str, int],
) -> list[str]:
    """The opening lines: who is who, and what is going to happen."""
    s, b = settings, screen.paint
    fail_at, recover_at = script[0].at, script[-1].at
    backoff = s["backoff_initial_ms"]
    when = ", ".join(f"at {p.at:g} s {p.label}" for p in script)
    return [
        b("sidecar demo", "bold") + ": a circuit breaker in front of a flaky LLM provider",
        f"{seconds:g} s of traffic, then a summary; everything runs here, on 127.0.0.1",
        "",
        f"  primary   fake provider {fakes['primary'].url:<24}"
        f"fails from {fail_at:g} s to {recover_at:g} s",
        f"  fallback  fake provider {fakes['fallback'].url:<24}always healthy",
        f"  sidecar   proxy         {sidecar.proxy_url:<24}/v1/ -> primary, then fallback",
        f"            admin         {sidecar.admin_url:<24}GET /status?all=1, /metrics",
        "",
        f"  primary:  {s['max_retries']} retries (backoff {backoff}, {2 * backoff} ms), "
        f"first-byte timeout {s['first_byte_timeout_ms'] / 1000:g} s;",
        f"            breaker opens after {s['failure_threshold']} failed calls in a row, "
        f"probes after {s['cooldown_ms'] / 1000:g} s",
        f"  traffic:  {rate:g} requests/s: streamed (SSE) and JSON chat completions, embeddings",
        f"  script:   primary ok, {when}",
        "  twin:     a second sidecar WITHOUT a breaker gets the same traffic (own fakes,",
        '            same faults): the "no breaker" column and the comparison at the end',
        "",
    ]


_ROW = "{t:>5}  {state} {p:>7} {f:>8}  {a:>8} {l:>6}  {c:>7} {n:>10}"
_STATE_W = 18


def table_header(screen: Screen) -> list[str]:
    """The two header lines of the per-second table."""
    top = f"{'':>5}  {'breaker on':<{_STATE_W}} {'served by':^16}  {'per request':^15}  "
    top += f"{'calls to primary':^18}"
    cols = _ROW.format(
        t="t",
        state=f"{'primary':<{_STATE_W}}",
        p="primary",
        f="fallback",
        a="attempts",
        l="p50",
        c="breaker",
        n="no breaker",
    )
    return [screen.paint(top.rstrip(), "dim"), screen.paint(cols, "dim")]


def table_row(
    screen: Screen,
    second: int,
    done: Sequence[Result],
    status: Mapping[str, Any],
    calls: int,
    twin_calls: int,
) -> str:
    """One second: the breaker state now, and the requests that completed in that second."""
    entry: Mapping[str, Any] = {}
    for b in status.get("breakers", []) if isinstance(status, Mapping) else []:
        if isinstance(b, Mapping) and b.get("upstream") == "primary":
            entry = b
    state = str(entry.get("state", "?"))
    retry_in = seconds_until(entry.get("retry_at")) if state == "open" else None
    primary = sum(1 for r in done if r.ok and r.upstream == "primary")
    fallback = sum(1 for r in done if r.ok and r.upstream == "fallback")
    failed = sum(1 for r in done if not r.ok)
    attempts = f"{sum(r.attempts for r in done) / len(done):.1f}" if done else "-"
    p50 = percentile([r.latency_ms for r in done], 50)
    row = _ROW.format(
        t=f"{second}s",
        state=state_text(screen, state, retry_in, _STATE_W),
        p=primary,
        f=fallback,
        a=attempts,
        l=fmt_ms(p50),
        c=calls,
        n=twin_calls,
    )
    if failed:
        row += screen.paint(f"  {failed} failed", "bold", "red")
    return row


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


class Report:
    """Collects phase marks and fake counters during the run; writes the summary."""

    def __init__(
        self,
        screen: Screen,
        story: Story,
        seconds: float,
        script: Sequence[Phase],
        settings: Mapping[str, int],
    ) -> None:
        self.screen = screen
        self.story = story
        self.seconds = seconds
        self.script = script
        self.settings = settings
        self.marks: dict[str, tuple[float, dict[str, int]]] = {}
        self.stopped_at: float | None = None

    def _counts(self, fakes: Mapping[str, FakeUpstream]) -> dict[str, int]:
        return {name: fakes[name].request_count for name in PRIMARIES}

    def phase_started(self, phase: Phase, fakes: Mapping[str, FakeUpstream]) -> None:
        """Both primaries just switched to ``phase``: note it on screen and in the marks."""
        self.marks[phase.name] = (self.story.now(), self._counts(fakes))
        self.story.event(phase.note, "bold", marker="--")

    def counts_at_end(self, fakes: Mapping[str, FakeUpstream]) -> None:
        """Snapshot the counters once the traffic is over."""
        self.marks["end"] = (self.stopped_at or self.story.now(), self._counts(fakes))

    def summary(
        self,
        results: Mapping[str, Sequence[Result]],
        before: Samples,
        after: Samples,
        *,
        interrupted: bool,
    ) -> list[str]:
        """The closing lines."""
        b = self.screen.paint
        main, twin = results["main"], results["twin"]
        n, ok = len(main), sum(1 for r in main if r.ok)
        streamed = sum(1 for r in main if r.stream)
        ran = self.stopped_at if self.stopped_at is not None else self.seconds
        title = f"summary: {ran:.1f} s of traffic, {n} requests ({streamed} streamed, "
        title += f"{n - streamed} JSON)"
        if interrupted:
            title += ", interrupted"
        by_primary = sum(1 for r in main if r.ok and r.upstream == "primary")
        by_fallback = sum(1 for r in main if r.ok and r.upstream == "fallback")
        st = self.story
        labels = {"upstream": "primary", "model": "*"}
        opened = _metric(after, "sidecar_breaker_transitions_total", to="open", **labels)
        opened -= _metric(before, "sidecar_breaker_transitions_total", to="open", **labels)
        skipped = _metric(after, "sidecar_breaker_rejections_total", **labels)
        skipped -= _metric(before, "sidecar_breaker_rejections_total", **labels)
        ok_style = ("bold", "green") if ok == n else ("bold", "red")
        probes = f"{st.probes_failed} failed, {st.probes_ok} succeeded"
        return [
            "",
            b(title, "bold"),
            f"  success rate seen by the app  {b(f'{ok}/{n} ({_pct(ok, n)})', *ok_style)}",
            f"  served by                     primary {by_primary}, fallback {by_fallback}",
            f"  breaker openings on primary   {opened:.0f} (probes: {probes})",
            f"  requests that skipped primary {skipped:.0f} (breaker open: no call made)",
            *self._outage(main, twin),
        ]

    def _outage(self, main: Sequence[Result], twin: Sequence[Result]) -> list[str]:
        b = self.screen.paint
        start = self.marks.get("503")
        end = self.marks.get("ok") or self.marks.get("end")
        if start is None or end is None:
            return ["  (stopped before the outage: nothing to compare)"]
        (t1, c1), (t2, c2) = start, end
        inside = [r for r in main if t1 <= r.started < t2]
        inside_twin = [r for r in twin if t1 <= r.started < t2]
        calls, calls_twin = c2["primary"] - c1["primary"], c2["twin_primary"] - c1["twin_primary"]

        def per_req(rs: Sequence[Result]) -> str:
            return f"{sum(r.attempts for r in rs) / len(rs):.1f}" if rs else "-"

        def lat(rs: Sequence[Result]) -> str:
            ms = [r.latency_ms for r in rs]
            return f"{fmt_ms(percentile(ms, 50))} / {fmt_ms(percentile(ms, 95))}"

        def full(rs: Sequence[Result]) -> str:
            return f"{sum(1 for r in rs if r.ok)}/{len(rs)}"

        rows: Iterable[tuple[str, str, str]] = (
            ("calls to primary", str(calls), str(calls_twin)),
            ("attempts per request", per_req(inside), per_req(inside_twin)),
            ("latency p50 / p95", lat(inside), lat(inside_twin)),
            ("full answers", full(inside), full(inside_twin)),
        )
        s = self.settings
        lines = [
            "",
            b(f"during the outage ({t1:.1f} s to {t2:.1f} s, {len(inside)} requests)", "bold"),
            f"  {'':<22}{'with the breaker':>20}{'without (twin)':>20}",
            *(f"  {name:<22}{a:>20}{c:>20}" for name, a, c in rows),
        ]
        if calls_twin:
            saved = f"{100 * (1 - calls / calls_twin):.0f}%"
            lines.append(
                "  "
                + b(
                    f"upstream calls to the failing provider: {calls} instead of {calls_twin} "
                    f"({saved} fewer)",
                    "bold",
                    "green",
                )
            )
        lines += [
            f"  Without a breaker every request paid 1 + {s['max_retries']} attempts on primary "
            "while it",
            f"  answered 503, or waited {s['first_byte_timeout_ms'] / 1000:g} s for it while it "
            "hung, before falling back.",
            '  "without" is measured: a twin sidecar with no breaker got the same traffic.',
        ]
        return lines

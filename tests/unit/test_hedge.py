"""Hedged first token's pure parts: the route key ``hedge_after_ms`` (decoded, validated,
compiled, linted), the hedge's choice of candidate (:func:`sidecar.hedge.search`), and
the race's state (:class:`sidecar.hedge.Race`) without a network.

The race through the running sidecar: tests/e2e/test_hedge.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sidecar.breakers.types import Permit, Target
from sidecar.config import ConfigError, parse_config, parse_config_with_warnings
from sidecar.exchange import FIRST_BYTE, Exchange
from sidecar.hedge import HEDGED, LOST, NOT_SENT, Race, child_exchange, search
from sidecar.outcome import UpstreamError, UpstreamTimeout
from sidecar.retry_budget import RetryBudget
from sidecar.routes import Candidate, RouteTable
from sidecar.testing import FakeClock
from tests.configs import config, route, upstream

URL = "http://127.0.0.1:1"


def hedging(after: Any, *names: str, **upstream_keys: Any) -> str:
    cands = names or ("primary", "backup")
    return config(
        upstreams={n: upstream(URL, **upstream_keys) for n in ("primary", "backup")},
        routes=[route("chat", *cands, path_prefix="/v1/", hedge_after_ms=after)],
    )


# -- the config key ---------------------------------------------------------------------------


def test_hedge_after_ms_defaults_to_off() -> None:
    plain = config(
        upstreams={"primary": upstream(URL)}, routes=[route("chat", "primary", path_prefix="/")]
    )
    c = parse_config(plain, {})
    assert c.routes[0].hedge_after_ms == 0
    assert RouteTable(c).routes[0].hedge_after_s == 0.0


def test_hedge_after_ms_is_compiled_to_seconds() -> None:
    c = parse_config(hedging(1500), {})
    assert c.routes[0].hedge_after_ms == 1500
    assert RouteTable(c).routes[0].hedge_after_s == 1.5


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "must be >= 0"),
        ("1000", "expected an integer, got a string"),
        (1.5, "expected an integer, got a float"),
        (True, "expected an integer, got a boolean"),
    ],
)
def test_hedge_after_ms_must_be_a_whole_number_of_ms(value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(hedging(value), {})
    assert exc.value.errors == [f"routes[0].hedge_after_ms: {message}"]


def warnings_of(text: str) -> list[str]:
    return [f"{k}: {m}" for k, m in parse_config_with_warnings(text, {}).warnings]


def test_a_hedge_with_no_next_candidate_is_a_warning() -> None:
    assert warnings_of(hedging(1000, "primary")) == [
        "upstreams.backup: no route uses this upstream",
        "routes[0].hedge_after_ms: the route has one candidate: there is no next one to hedge to",
    ]


def test_a_hedge_never_due_before_the_first_byte_timeout_is_a_warning() -> None:
    assert warnings_of(hedging(5000, first_byte_timeout_ms=5000)) == [
        "routes[0].hedge_after_ms: not shorter than the first candidate's "
        "first_byte_timeout_ms (upstreams.primary): it times out before a hedge is due"
    ]
    assert warnings_of(hedging(4999, first_byte_timeout_ms=5000)) == []
    assert warnings_of(hedging(0, "primary")) == ["upstreams.backup: no route uses this upstream"]


# -- the hedge's candidate --------------------------------------------------------------------


def cand(name: str) -> Candidate:
    return Candidate(name, None, Target(name, "*"))


def permit(name: str, probe: bool = False) -> Permit:
    return Permit(Target(name, "*"), 0, probe)


class Breakers:
    """Answers per upstream name: "open", "ramp", "probe", or a plain permit."""

    def __init__(self, **states: str) -> None:
        self.states = states
        self.asked: list[str] = []
        self.released: list[str] = []

    def admit(self, c: Candidate) -> tuple[Permit | None, str]:
        self.asked.append(c.upstream)
        state = self.states.get(c.upstream, "closed")
        if state in ("circuit_open", "ramp"):
            return None, state
        return permit(c.upstream, probe=state == "probe"), ""

    def release(self, p: Permit) -> None:
        self.released.append(p.target.upstream)


def run_search(breakers: Breakers, *names: str) -> tuple[Any, list[tuple[str, str | None]], Any]:
    order = iter([cand(n) for n in names])
    found, passed = search(order, breakers.admit, lambda p: not p.probe, breakers.release)
    return found, [(c.upstream, why) for c, why in passed], order


def test_the_next_candidate_is_the_hedge() -> None:
    b = Breakers()
    found, passed, order = run_search(b, "b", "c")
    assert found == (cand("b"), permit("b"))
    assert passed == []
    assert [c.upstream for c in order] == ["c"]  # the rest is left to the fallback loop
    assert b.asked == ["b"]


def test_candidates_their_breakers_refuse_are_passed_over_with_their_reason() -> None:
    b = Breakers(b="circuit_open", c="ramp")
    found, passed, _ = run_search(b, "b", "c", "d")
    assert found == (cand("d"), permit("d"))
    assert passed == [("b", "circuit_open"), ("c", "ramp")]
    assert b.released == []


def test_a_probe_is_never_a_hedge_it_is_released_and_left_to_the_loop() -> None:
    b = Breakers(b="probe")
    found, passed, _ = run_search(b, "b", "c")
    assert found == (cand("c"), permit("c"))
    assert passed == [("b", None)]  # asked again by the fallback loop
    assert b.released == ["b"]


def test_no_candidate_left_no_hedge() -> None:
    b = Breakers(b="circuit_open")
    found, passed, _ = run_search(b, "b")
    assert found is None
    assert passed == [("b", "circuit_open")]
    assert run_search(Breakers())[0] is None


# -- the race's state -------------------------------------------------------------------------


async def test_the_race_reads_pending_candidates_before_the_order() -> None:
    ex = Exchange(FakeClock(), asyncio.current_task(), 0.0)  # type: ignore[arg-type]
    race: Race[str] = Race(1.0, iter([cand("c"), cand("d")]), ex)
    race.pending.extend([(cand("a"), "circuit_open"), (cand("b"), HEDGED)])
    got = []
    while (item := race.next()) is not None:
        got.append((item[0].upstream, item[1]))
    assert got == [("a", "circuit_open"), ("b", HEDGED), ("c", None), ("d", None)]


async def test_the_timer_is_the_clocks_and_disarmed_with_the_call() -> None:
    clock = FakeClock()
    ex = Exchange(clock, asyncio.current_task(), 0.0)  # type: ignore[arg-type]
    race: Race[str] = Race(1.0, iter(()), ex)
    fired: list[float] = []
    race.arm(clock, lambda: fired.append(clock.now()))
    clock.advance(0.999)
    assert fired == []
    clock.advance(0.001)
    assert fired == [clock.now()]
    race.arm(clock, lambda: fired.append(-1.0))
    race.disarm()
    clock.advance(5.0)
    assert fired == [1001.0]


def test_a_child_exchange_shares_the_request_deadline_only() -> None:
    clock = FakeClock()
    ex = Exchange(clock, None, clock.now())  # type: ignore[arg-type]
    ex.route = "chat"
    ex.start_request(5.0)
    ex.raw_head = True
    ex.attempts = 3
    child = child_exchange(ex)
    assert (child.route, child.request_at, child.raw_head) == ("chat", ex.request_at, True)
    assert (child.attempts, child.phase, child.started) == (0, None, ex.started)


async def test_a_hedge_task_merges_its_counts_and_gives_its_budget_back() -> None:
    clock = FakeClock()
    ex = Exchange(clock, asyncio.current_task(), clock.now())  # type: ignore[arg-type]
    ex.attempts = 1
    race: Race[str] = Race(1.0, iter(()), ex)
    budget = RetryBudget(0, 1)
    assert budget.take()
    child = child_exchange(ex)

    async def call() -> tuple[str | UpstreamError, str | None]:
        child.attempts += 1
        child.upstream_error = "http_503"
        return "answer", "failure"

    race.launch(cand("b"), permit("b"), budget, child, call, lambda p: None)
    assert race.outcome == LOST  # until relayed
    assert race.task is not None
    await race.task
    assert (ex.attempts, ex.upstream_error) == (2, "http_503")
    assert budget.retries == 0
    assert race.take() == ("answer", "failure")
    assert race.take() is None


async def test_a_hedge_stopped_before_it_began_sends_nothing_and_settles() -> None:
    clock = FakeClock()
    ex = Exchange(clock, asyncio.current_task(), clock.now())  # type: ignore[arg-type]
    race: Race[str] = Race(1.0, iter(()), ex)
    budget = RetryBudget(0, 1)
    assert budget.take()
    released: list[Permit] = []
    called: list[bool] = []

    async def call() -> tuple[str | UpstreamError, str | None]:
        called.append(True)
        return "answer", None

    race.launch(cand("b"), permit("b"), budget, child_exchange(ex), call, released.append)
    await race.stop()  # before its first step
    assert called == []
    assert released == [permit("b")]
    assert budget.retries == 0


async def test_a_hedge_cut_by_the_deadline_joins_as_a_timeout() -> None:
    clock = FakeClock()
    ex = Exchange(clock, asyncio.current_task(), clock.now())  # type: ignore[arg-type]
    race: Race[str] = Race(1.0, iter(()), ex)
    budget = RetryBudget(0, 1)
    assert budget.take()
    gate = asyncio.Event()

    async def call() -> tuple[str | UpstreamError, str | None]:
        await gate.wait()
        return "answer", None

    race.launch(cand("b"), permit("b"), budget, child_exchange(ex), call, lambda p: None)
    await asyncio.sleep(0)  # it starts and waits
    assert race.task is not None
    race.task.cancel()  # as its own timer would
    result, moved = await race.join()
    assert isinstance(result, UpstreamTimeout)
    assert moved == "failure"
    assert budget.retries == 0


def test_not_sent_is_an_outcome() -> None:
    ex = Exchange(FakeClock(), None, 0.0)  # type: ignore[arg-type]
    race: Race[str] = Race(1.0, iter(()), ex)
    before = race.outcome
    race.fire()  # nothing armed: the hedge is decided, here not sent
    race.not_sent()
    assert before is None
    assert (race.due, race.outcome) == (False, NOT_SENT)


async def test_the_hedge_rides_the_exchanges_one_timer_and_the_deadlines_still_fire() -> None:
    """The hedge's time is served by the request's one timer (no timer of its own):
    armed sooner for the hedge, re-armed after it for the first-byte deadline, which
    still cancels the handler's task; a disarmed hedge never fires."""
    clock = FakeClock()
    blocked = asyncio.Event()
    task = asyncio.ensure_future(blocked.wait())
    ex = Exchange(clock, task, clock.now())
    ex.start_request(10.0)
    race: Race[str] = Race(1.0, iter(()), ex)
    fired: list[float] = []
    race.arm(clock, lambda: fired.append(clock.now()))
    ex.start(FIRST_BYTE, 5.0)
    clock.advance(1.0)
    assert fired == [1001.0] and not task.cancelled()
    clock.advance(4.0)  # the first-byte deadline: the handler's task is cancelled
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ex.expired_phase == FIRST_BYTE
    ex.close()

    ex2 = Exchange(clock, asyncio.current_task(), clock.now())  # type: ignore[arg-type]
    race2: Race[str] = Race(1.0, iter(()), ex2)
    race2.arm(clock, lambda: fired.append(-1.0))
    race2.disarm()
    clock.advance(2.0)
    assert fired == [1001.0]
    ex2.close()

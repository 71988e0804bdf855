"""The breaker's transition table, row by row (interface.md, "The circuit breaker").

Each row: settings, a start state, one event, and the expected state, transitions and
return value. Every (state x event) pair has at least one row, including stale
permits, impossible events (which must leave the state untouched), Retry-After
extension and non-shortening, and thresholds and probe counts above 1.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
from msgspec.structs import replace

from sidecar.breakers.machine import (
    Breakers,
    BreakerSettings,
    BreakerState,
    Permit,
    State,
    Target,
    Transition,
    Verdict,
)

T = Target("openai", "gpt-4o")
OTHER = Target("backup", "*")
ONE = BreakerSettings(
    failure_threshold=1, cooldown_s=10.0, half_open_max_probes=1, success_threshold=1
)
MANY = BreakerSettings(
    failure_threshold=3, cooldown_s=10.0, half_open_max_probes=2, success_threshold=2
)
G = 5  # the start state's generation; permits of G are current, of G - 1 stale
NOW = 100.0
S, F, N = Verdict.SUCCESS, Verdict.FAILURE, Verdict.NEUTRAL
CLOSED, OPEN, HALF = State.CLOSED, State.OPEN, State.HALF_OPEN


def bs(
    state: State = CLOSED,
    *,
    gen: int = G,
    fails: int = 0,
    wins: int = 0,
    probes: int = 0,
    opened: float | None = None,
    retry: float | None = None,
    last: str | None = None,
) -> BreakerState:
    return BreakerState(state, gen, fails, wins, probes, opened, retry, last)


C0 = bs(CLOSED, fails=2, last="http_500")  # one failure short of MANY's threshold
O0 = bs(OPEN, fails=3, opened=95.0, retry=105.0, last="timeout")  # due at 105
H0 = bs(HALF, fails=3, opened=80.0, retry=90.0, last="timeout")
OPENED = bs(OPEN, gen=G + 1, fails=3, opened=NOW, retry=NOW + 10.0, last="connect_error")


# Events: one call on the Breakers under test.
class Admit(NamedTuple):
    now: float = NOW


class Record(NamedTuple):
    verdict: Verdict
    gen: int = G
    probe: bool = False
    retry_after: float | None = None
    last: str | None = "connect_error"
    now: float = NOW


class Release(NamedTuple):
    gen: int = G
    probe: bool = True


class Tick(NamedTuple):
    now: float = NOW


class Note(NamedTuple):
    retry_after: float
    now: float = NOW


Event = Admit | Record | Release | Tick | Note


class Row(NamedTuple):
    id: str
    settings: BreakerSettings
    start: BreakerState
    event: Event
    expect: BreakerState  # the state after the event
    moves: tuple[tuple[State, State], ...] = ()
    returns: Permit | None = None


def same(row_id: str, settings: BreakerSettings, start: BreakerState, event: Event) -> Row:
    """A row whose event must leave the state untouched and move nothing."""
    return Row(row_id, settings, start, event, start)


ROWS = [
    # --- closed ---
    Row("closed/admit", MANY, C0, Admit(), C0, returns=Permit(T, G, False)),
    Row("closed/success resets count", MANY, C0, Record(S), replace(C0, consecutive_failures=0)),
    Row(
        "closed/failure below threshold counts",
        MANY,
        bs(fails=1),
        Record(F, last="http_503"),
        bs(fails=2, last="http_503"),
    ),
    Row(
        "closed/failure below threshold ignores retry_after",
        MANY,
        bs(fails=1),
        Record(F, retry_after=30.0),
        bs(fails=2, last="connect_error"),
    ),
    Row(
        "closed/failure without last_failure keeps the old one",
        MANY,
        bs(fails=1, last="timeout"),
        Record(F, last=None),
        bs(fails=2, last="timeout"),
    ),
    Row("closed/failure at threshold opens", MANY, C0, Record(F), OPENED, ((CLOSED, OPEN),)),
    Row(
        "closed/failure at threshold 1 opens",
        ONE,
        bs(),
        Record(F),
        replace(OPENED, consecutive_failures=1),
        ((CLOSED, OPEN),),
    ),
    Row(
        "closed/opening honours a longer retry_after",
        MANY,
        C0,
        Record(F, retry_after=30.0),
        replace(OPENED, retry_at=NOW + 30.0),
        ((CLOSED, OPEN),),
    ),
    Row(
        "closed/opening never shorter than cooldown",
        MANY,
        C0,
        Record(F, retry_after=3.0),
        OPENED,
        ((CLOSED, OPEN),),
    ),
    same("closed/neutral", MANY, C0, Record(N)),
    same("closed/stale success", MANY, C0, Record(S, gen=G - 1)),
    same("closed/stale failure", MANY, C0, Record(F, gen=G - 1)),
    same("closed/stale failure with retry_after", MANY, C0, Record(F, gen=G - 1, retry_after=30.0)),
    same("closed/stale neutral", MANY, C0, Record(N, gen=G - 1)),
    same("closed/impossible current probe permit", MANY, C0, Record(F, probe=True)),
    same("closed/release non-probe", MANY, C0, Release(probe=False)),
    same("closed/release stale probe", MANY, C0, Release(gen=G - 1)),
    same("closed/tick", MANY, C0, Tick(1e9)),
    same("closed/note retry_after", MANY, C0, Note(30.0)),
    # --- open (due at 105) ---
    Row("open/admit before due skips", MANY, O0, Admit(104.9), O0, returns=None),
    Row(
        "open/admit when due moves and probes",
        MANY,
        O0,
        Admit(105.0),
        replace(O0, state=HALF, generation=G + 1, probes_in_flight=1),
        ((OPEN, HALF),),
        Permit(T, G + 1, True),
    ),
    Row(
        "open/admit long after due moves and probes",
        ONE,
        O0,
        Admit(1e6),
        replace(O0, state=HALF, generation=G + 1, probes_in_flight=1),
        ((OPEN, HALF),),
        Permit(T, G + 1, True),
    ),
    same("open/stale success", MANY, O0, Record(S, gen=G - 1)),
    same("open/stale failure", MANY, O0, Record(F, gen=G - 1, last="http_503")),
    same("open/stale neutral", MANY, O0, Record(N, gen=G - 1)),
    same("open/stale probe failure", MANY, O0, Record(F, gen=G - 1, probe=True)),
    Row(
        "open/stale failure retry_after extends",
        MANY,
        O0,
        Record(F, gen=G - 1, retry_after=20.0),
        replace(O0, retry_at=NOW + 20.0),
    ),
    same(
        "open/stale failure retry_after never shortens",
        MANY,
        O0,
        Record(F, gen=G - 1, retry_after=2.0),
    ),
    same(
        "open/retry_after once due changes nothing",
        MANY,
        O0,
        Record(F, gen=G - 1, retry_after=50.0, now=106.0),
    ),
    same(
        "open/stale success retry_after ignored", MANY, O0, Record(S, gen=G - 1, retry_after=50.0)
    ),
    same(
        "open/stale neutral retry_after ignored", MANY, O0, Record(N, gen=G - 1, retry_after=50.0)
    ),
    same("open/impossible current success", MANY, O0, Record(S)),
    same("open/impossible current failure", MANY, O0, Record(F)),
    same("open/impossible current neutral", MANY, O0, Record(N, probe=True)),
    same("open/release stale probe", MANY, O0, Release(gen=G - 1)),
    same("open/release impossible current probe", MANY, O0, Release()),
    same("open/tick before due", MANY, O0, Tick(104.9)),
    Row(
        "open/tick when due",
        MANY,
        O0,
        Tick(105.0),
        replace(O0, state=HALF, generation=G + 1),
        ((OPEN, HALF),),
    ),
    Row("open/note extends", MANY, O0, Note(20.0), replace(O0, retry_at=NOW + 20.0)),
    same("open/note never shortens", MANY, O0, Note(2.0)),
    same("open/note once due changes nothing", MANY, O0, Note(50.0, now=105.0)),
    # --- half_open (MANY: 2 probe slots, 2 successes to close) ---
    Row(
        "half/admit takes a slot",
        MANY,
        H0,
        Admit(),
        replace(H0, probes_in_flight=1),
        returns=Permit(T, G, True),
    ),
    Row(
        "half/admit takes the second slot",
        MANY,
        replace(H0, probes_in_flight=1),
        Admit(),
        replace(H0, probes_in_flight=2),
        returns=Permit(T, G, True),
    ),
    Row(
        "half/admit full skips",
        MANY,
        replace(H0, probes_in_flight=2),
        Admit(),
        replace(H0, probes_in_flight=2),
    ),
    Row(
        "half/admit full at 1 skips",
        ONE,
        replace(H0, probes_in_flight=1),
        Admit(),
        replace(H0, probes_in_flight=1),
    ),
    Row(
        "half/probe success below threshold",
        MANY,
        replace(H0, probes_in_flight=2),
        Record(S, probe=True),
        replace(H0, probes_in_flight=1, probe_successes=1),
    ),
    Row(
        "half/probe success at threshold closes",
        MANY,
        replace(H0, probes_in_flight=2, probe_successes=1),
        Record(S, probe=True),
        bs(CLOSED, gen=G + 1, last="timeout"),
        ((HALF, CLOSED),),
    ),
    Row(
        "half/probe success at threshold 1 closes",
        ONE,
        replace(H0, probes_in_flight=1),
        Record(S, probe=True),
        bs(CLOSED, gen=G + 1, last="timeout"),
        ((HALF, CLOSED),),
    ),
    Row(
        "half/probe failure reopens for a cooldown",
        MANY,
        replace(H0, probes_in_flight=2, probe_successes=1),
        Record(F, probe=True, last="http_503"),
        bs(OPEN, gen=G + 1, fails=4, opened=NOW, retry=NOW + 10.0, last="http_503"),
        ((HALF, OPEN),),
    ),
    Row(
        "half/probe failure honours a longer retry_after",
        ONE,
        replace(H0, probes_in_flight=1),
        Record(F, probe=True, retry_after=30.0),
        bs(OPEN, gen=G + 1, fails=4, opened=NOW, retry=NOW + 30.0, last="connect_error"),
        ((HALF, OPEN),),
    ),
    Row(
        "half/probe neutral frees the slot",
        MANY,
        replace(H0, probes_in_flight=2, probe_successes=1),
        Record(N, probe=True),
        replace(H0, probes_in_flight=1, probe_successes=1),
    ),
    same("half/probe neutral never below zero", MANY, H0, Record(N, probe=True)),
    same(
        "half/stale probe success",
        MANY,
        replace(H0, probes_in_flight=1),
        Record(S, gen=G - 1, probe=True),
    ),
    same(
        "half/stale probe failure with retry_after",
        MANY,
        replace(H0, probes_in_flight=1),
        Record(F, gen=G - 1, probe=True, retry_after=30.0),
    ),
    same(
        "half/stale neutral",
        MANY,
        replace(H0, probes_in_flight=1),
        Record(N, gen=G - 1, probe=True),
    ),
    same(
        "half/stale closed-era failure", MANY, replace(H0, probes_in_flight=1), Record(F, gen=G - 2)
    ),
    same(
        "half/impossible current non-probe success", ONE, replace(H0, probes_in_flight=1), Record(S)
    ),
    same(
        "half/impossible current non-probe failure", ONE, replace(H0, probes_in_flight=1), Record(F)
    ),
    same(
        "half/impossible current non-probe neutral", ONE, replace(H0, probes_in_flight=1), Record(N)
    ),
    Row(
        "half/release frees a slot",
        MANY,
        replace(H0, probes_in_flight=2),
        Release(),
        replace(H0, probes_in_flight=1),
    ),
    same("half/release never below zero", MANY, H0, Release()),
    same("half/release stale probe", MANY, replace(H0, probes_in_flight=1), Release(gen=G - 1)),
    same("half/release non-probe", MANY, replace(H0, probes_in_flight=1), Release(probe=False)),
    same("half/tick", MANY, replace(H0, probes_in_flight=1), Tick(1e9)),
    same("half/note retry_after", MANY, replace(H0, probes_in_flight=1), Note(30.0)),
]


def run(b: Breakers, event: Event) -> tuple[Permit | None, list[Transition]]:
    """Apply one event; the permit (admit only) and every transition it handed out."""
    match event:
        case Admit(now):
            return b.admit(T, now), b.drain_transitions()
        case Record(verdict, gen, probe, retry_after, last, now):
            permit = Permit(T, gen, probe)
            return None, b.record(
                permit, verdict, now, last_failure=last, retry_after_s=retry_after
            )
        case Release(gen, probe):
            b.release(Permit(T, gen, probe))
            return None, []
        case Tick(now):
            return None, b.tick(now)
        case Note(retry_after, now):
            b.note_retry_after(T, retry_after, now)
            return None, []
    raise AssertionError(event)


def breakers_at(settings: BreakerSettings, start: BreakerState) -> Breakers:
    b = Breakers({T: settings, OTHER: settings})
    b._states[T] = start  # a white-box start state, as h11's tests do
    return b


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_transition_table(row: Row) -> None:
    b = breakers_at(row.settings, row.start)
    returned, moves = run(b, row.event)
    assert b.state(T) == row.expect
    assert [(m.from_state, m.to_state) for m in moves] == list(row.moves)
    after_move = row.expect
    if isinstance(row.event, Admit) and row.returns is not None and row.returns.probe:
        # admit makes the due move first, then takes the probe slot
        after_move = replace(row.expect, probes_in_flight=row.expect.probes_in_flight - 1)
    assert all(m.target == T and m.state == after_move for m in moves)
    assert returned == row.returns
    assert b.drain_transitions() == []  # handed out once
    assert b.state(OTHER) == bs(gen=0)  # other targets untouched


def _kind(row: Row) -> tuple[State, str]:
    e = row.event
    if isinstance(e, Record):
        return row.start.state, f"record {e.verdict.value} {'current' if e.gen == G else 'stale'}"
    return row.start.state, type(e).__name__


def test_table_covers_every_state_and_event() -> None:
    verdicts = [f"record {v.value} {age}" for v in Verdict for age in ("current", "stale")]
    wanted = {(s, k) for s in State for k in [*verdicts, "Admit", "Release", "Tick", "Note"]}
    assert wanted <= {_kind(r) for r in ROWS}


def test_new_breakers_start_closed() -> None:
    b = Breakers({T: MANY})
    assert b.state(T) == bs(gen=0)
    assert list(b.items()) == [(T, bs(gen=0))]
    assert b.has(T)
    assert b.next_deadline() is None


def test_target_without_breaker_is_always_admitted() -> None:
    b = Breakers({T: ONE})
    assert not b.has(OTHER)
    assert b.state(OTHER) is None
    permit = b.admit(OTHER, NOW)
    assert permit == Permit(OTHER, -1, False)
    for _ in range(5):
        assert b.record(permit, F, NOW, retry_after_s=60.0) == []
    b.release(permit)
    b.note_retry_after(OTHER, 60.0, NOW)
    assert b.admit(OTHER, NOW) is not None
    assert b.state(OTHER) is None
    assert b.retry_in([OTHER], NOW) == 0.0
    assert b.state(T) == bs(gen=0)


@pytest.mark.parametrize(
    "fields",
    [
        {"failure_threshold": 0},
        {"half_open_max_probes": 0},
        {"success_threshold": 0},
        {"cooldown_s": 0.0},
        {"cooldown_s": -1.0},
    ],
)
def test_settings_reject_non_positive(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        replace(ONE, **fields)


def test_full_cycle_hands_out_each_transition_once() -> None:
    b = Breakers({T: BreakerSettings(2, 10.0, 1, 1)})
    early = b.admit(T, NOW)
    first = b.admit(T, NOW)
    assert early is not None and first is not None
    assert b.record(first, F, NOW, last_failure="timeout") == []
    second = b.admit(T, NOW)
    assert second is not None
    [opened] = b.record(second, F, NOW + 1, last_failure="http_503")
    assert (opened.from_state, opened.to_state) == (CLOSED, OPEN)
    assert opened.state == b.state(T)
    assert b.admit(T, NOW + 5) is None
    assert b.next_deadline() == NOW + 11
    # The call admitted before the breaker opened fails late with a Retry-After.
    assert b.record(early, F, NOW + 6, retry_after_s=20.0) == []
    assert b.next_deadline() == NOW + 26
    assert b.tick(NOW + 25) == []
    [half] = b.tick(NOW + 26)
    assert (half.from_state, half.to_state) == (OPEN, HALF)
    assert b.tick(NOW + 27) == []
    assert b.drain_transitions() == []
    probe = b.admit(T, NOW + 27)
    assert probe is not None and probe.probe
    assert b.admit(T, NOW + 27) is None
    [closed] = b.record(probe, S, NOW + 28)
    assert (closed.from_state, closed.to_state) == (HALF, CLOSED)
    assert closed.state == bs(gen=3, last="http_503")
    # A result from before the breaker opened is stale after it closed.
    assert b.record(first, F, NOW + 29) == []
    assert b.state(T) == closed.state


def test_admit_applies_a_late_timer_once() -> None:
    b = Breakers({T: ONE})
    b._states[T] = O0
    assert b.admit(T, 105.0) is not None
    [moved] = b.drain_transitions()
    assert (moved.from_state, moved.to_state) == (OPEN, HALF)
    assert b.drain_transitions() == []
    assert b.tick(200.0) == []  # already half-open: the timer finds nothing to move


def test_next_deadline_is_the_soonest_open_retry_at() -> None:
    third = Target("third", "*")
    b = Breakers({T: MANY, OTHER: MANY, third: MANY})
    b._states[T] = replace(O0, retry_at=130.0)
    b._states[OTHER] = replace(O0, retry_at=120.0)
    b._states[third] = H0  # half-open: retry_at 90 is in the past and not a deadline
    assert b.next_deadline() == 120.0
    assert [m.target for m in b.tick(125.0)] == [OTHER]
    assert b.next_deadline() == 130.0


def test_retry_in() -> None:
    third = Target("third", "*")
    b = Breakers({T: ONE, OTHER: ONE, third: ONE})
    assert b.retry_in([], NOW) is None
    assert b.retry_in([T], NOW) == 0.0  # closed
    b._states[T] = O0  # due at 105
    assert b.retry_in([T], NOW) == 5.0
    assert b.retry_in([T], 106.0) == 0.0  # due, timer late
    b._states[OTHER] = replace(O0, retry_at=103.0)
    assert b.retry_in([T, OTHER], NOW) == 3.0
    b._states[third] = replace(H0, probes_in_flight=1)  # half-open and full: unknown
    assert b.retry_in([third], NOW) is None
    assert b.retry_in([T, third], NOW) == 5.0
    b._states[third] = H0  # a free probe slot
    assert b.retry_in([T, third], NOW) == 0.0


def test_restore_keeps_configured_targets_exactly_with_their_probe_slots() -> None:
    """Contract, "Reload": states carry over exactly, a probe in flight with its slot, so
    no second probe is admitted; the old permit settles here and frees the slot."""
    b = Breakers({T: ONE})
    half_full = replace(H0, probes_in_flight=1)
    b.restore({T: half_full, OTHER: O0})
    assert b.state(T) == half_full
    assert not b.has(OTHER)
    assert b.admit(T, NOW) is None  # the one slot is the old generation's probe
    b.record(Permit(T, G, True), Verdict.NEUTRAL, NOW)
    assert b.admit(T, NOW) == Permit(T, G, True)

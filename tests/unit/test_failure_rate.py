"""The failure-rate rule (interface.md, "Choosing among candidates", "Failure rate"):
the window's counts against a plain list of calls, and the breaker's table rows.

The window is checked against a reference that keeps every call and counts those in
the buckets still inside the window: any sequence of calls at any times gives the same
counts (Hypothesis), so the ring's running sums never drift.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.breakers.machine import Breakers, BreakerSettings, State, Target, Verdict
from sidecar.breakers.window import BUCKETS, FailureWindow

T = Target("openai", "gpt-4o")
S, F, N = Verdict.SUCCESS, Verdict.FAILURE, Verdict.NEUTRAL


def rate(threshold: float = 0.3, minimum: int = 10, window: float = 60.0) -> BreakerSettings:
    """Consecutive rule out of the way (1000), so only the rate can open."""
    return BreakerSettings(
        failure_threshold=1000,
        cooldown_s=30.0,
        half_open_max_probes=1,
        success_threshold=1,
        failure_rate=threshold,
        window_s=window,
        minimum_calls=minimum,
    )


def call(b: Breakers, verdict: Verdict, now: float) -> list[State]:
    permit = b.admit(T, now)
    assert permit is not None, "the breaker skipped a call the test expected admitted"
    return [m.to_state for m in b.record(permit, verdict, now, last_failure="http_503")]


# -- the window -----------------------------------------------------------------


def reference(calls: list[tuple[float, bool]], now: float, window_s: float) -> tuple[int, int]:
    """Calls and failures in the buckets the window still holds at ``now``."""
    bucket = window_s / BUCKETS
    newest = int(now // bucket)
    kept = [f for t, f in calls if newest - int(t // bucket) < BUCKETS]
    return len(kept), sum(kept)


@pytest.mark.timeout(60)
@given(
    window=st.sampled_from([1.0, 10.0, 60.0, 0.5]),
    gaps=st.lists(
        st.tuples(st.floats(0, 20, allow_nan=False), st.booleans()), min_size=1, max_size=80
    ),
)
def test_the_window_counts_what_a_list_of_calls_would(
    window: float, gaps: list[tuple[float, bool]]
) -> None:
    w = FailureWindow(window)
    now = 1000.0
    calls: list[tuple[float, bool]] = []
    for gap, failed in gaps:
        now += gap * window / 10
        w.record(failed, now)
        calls.append((now, failed))
        assert (w.calls, w.failures) == reference(calls, now, window)
    later = now + window / 3
    w.advance(later)
    assert (w.calls, w.failures) == reference(calls, later, window)


def test_a_window_forgets_calls_older_than_its_length() -> None:
    w = FailureWindow(60.0)
    for i in range(10):  # 6 s buckets: calls at 120-125 and 126-129, two buckets
        w.record(i % 2 == 0, 120.0 + i)
    assert (w.calls, w.failures) == (10, 5)
    w.advance(120.0 + 59.0)  # the oldest bucket (from 120) is still inside
    assert (w.calls, w.failures) == (10, 5)
    w.advance(120.0 + 60.0)  # it leaves whole: the 6 calls at 120-125 go
    assert (w.calls, w.failures) == (4, 2)
    w.advance(120.0 + 66.0)  # and the bucket from 126
    assert (w.calls, w.failures) == (0, 0)


def test_a_long_quiet_gap_empties_the_window_in_one_step() -> None:
    w = FailureWindow(60.0)
    w.record(True, 10.0)
    w.advance(1e9)
    assert (w.calls, w.failures) == (0, 0)
    w.record(False, 1e9 + 1)
    assert (w.calls, w.failures) == (1, 0)


@pytest.mark.parametrize(
    ("calls", "failures", "threshold", "minimum", "opens"),
    [
        (10, 3, 0.3, 10, True),  # exactly the threshold opens (">= threshold")
        (10, 2, 0.3, 10, False),
        (9, 9, 0.3, 10, False),  # too few calls: never, whatever the share
        (20, 20, 1.0, 20, True),
        (3, 1, 1 / 3, 3, True),
    ],
)
def test_opens_at_the_threshold_with_enough_calls(
    calls: int, failures: int, threshold: float, minimum: int, opens: bool
) -> None:
    w = FailureWindow(60.0)
    for i in range(calls):
        w.record(i < failures, 5.0)
    assert w.opens(threshold, minimum) is opens


@pytest.mark.parametrize("window", [0.0, -1.0, math.inf, math.nan])
def test_a_window_must_have_a_length(window: float) -> None:
    with pytest.raises(ValueError, match="window_s"):
        FailureWindow(window)


# -- the breaker's rows -----------------------------------------------------------


def test_thirty_percent_failing_opens_a_breaker_the_consecutive_rule_never_would() -> None:
    b = Breakers({T: rate(threshold=0.3, minimum=10)})
    moves: list[State] = []
    now = 0.0
    for i in range(10):  # F S S F S S F S S S: 3 of 10, never two in a row
        now += 1.0
        moves += call(b, F if i in (0, 3, 6) else S, now)
        if i < 9:
            assert moves == [], f"opened early, at call {i + 1}"
    assert moves == [], "the 10th call is a success: a success never opens"
    moves += call(b, F, now + 1)  # 4 of 11
    assert moves == [State.OPEN]
    s = b.state(T)
    assert s is not None and s.last_failure == "http_503" and s.retry_at == now + 1 + 30.0


def test_neutral_calls_are_not_counted() -> None:
    b = Breakers({T: rate(threshold=0.5, minimum=4)})
    for now in (1.0, 2.0, 3.0):
        assert call(b, N, now) == []
    assert call(b, F, 4.0) == []  # 1 call: under minimum_calls (neutrals not counted)
    assert call(b, S, 5.0) == []
    assert call(b, N, 6.0) == []
    assert call(b, S, 7.0) == []
    assert call(b, F, 8.0) == [State.OPEN]  # 2 failures of 4 counted calls


def test_the_window_starts_empty_again_after_a_close() -> None:
    b = Breakers({T: rate(threshold=0.5, minimum=4)})
    for now, v in ((1.0, F), (2.0, S), (3.0, S)):
        call(b, v, now)
    assert call(b, F, 4.0) == [State.OPEN]
    # The cooldown passes, the probe succeeds: closed, with an empty window.
    assert b.tick(40.0) and b.state(T) is not None
    assert call(b, S, 40.0) == [State.CLOSED]
    # Three failures of four would open a full window; from empty it needs four calls.
    assert call(b, F, 41.0) == []
    assert call(b, F, 42.0) == []
    assert call(b, S, 43.0) == []
    assert call(b, F, 44.0) == [State.OPEN]


def test_calls_out_of_the_window_do_not_count() -> None:
    b = Breakers({T: rate(threshold=0.5, minimum=4, window=10.0)})
    call(b, F, 1.0)
    call(b, F, 2.0)
    call(b, F, 3.0)  # three failures, under minimum_calls
    # 15 s later they have left the 10 s window: one failure of four is 25 %.
    assert call(b, S, 15.0) == []
    assert call(b, S, 15.5) == []
    assert call(b, S, 16.0) == []
    assert call(b, F, 16.5) == []


def test_the_consecutive_rule_still_opens_on_its_own() -> None:
    settings = BreakerSettings(
        failure_threshold=2,
        cooldown_s=30.0,
        half_open_max_probes=1,
        success_threshold=1,
        failure_rate=0.9,
        window_s=60.0,
        minimum_calls=100,
    )
    b = Breakers({T: settings})
    assert call(b, F, 1.0) == []
    assert call(b, F, 2.0) == [State.OPEN]


def test_a_breaker_without_a_rate_keeps_no_window() -> None:
    b = Breakers({T: rate(threshold=0.0)})
    for i in range(50):
        assert call(b, F if i % 2 else S, float(i)) == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"failure_rate": 1.5}, "failure_rate"),
        ({"failure_rate": -0.1}, "failure_rate"),
        ({"minimum_calls": 0}, "window"),
        ({"window_s": 0.0}, "window"),
    ],
)
def test_settings_out_of_range_are_refused(changes: dict[str, float], message: str) -> None:
    base = {
        "failure_threshold": 3,
        "cooldown_s": 1.0,
        "half_open_max_probes": 1,
        "success_threshold": 1,
    }
    with pytest.raises(ValueError, match=message):
        BreakerSettings(**(base | changes))  # type: ignore[arg-type]

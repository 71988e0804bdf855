"""Paced recovery (interface.md, "Choosing among candidates", "Paced recovery"): after a
probe closes a breaker, it admits ``max(0.1, t / ramp_ms)`` of the calls at ``t`` after
the close, paced (no draw), and a failure during the ramp reopens it at once."""

from __future__ import annotations

import pytest

from sidecar.breakers.machine import Breakers, BreakerSettings, State, Target, Verdict, ramp_share

T = Target("openai", "gpt-4o")
RAMP = BreakerSettings(
    failure_threshold=1, cooldown_s=10.0, half_open_max_probes=1, success_threshold=1, ramp_s=100.0
)


def recovered(settings: BreakerSettings = RAMP) -> Breakers:
    """A breaker that opened at 0, went half-open at 10 and closed on a probe at 10."""
    b = Breakers({T: settings})
    permit = b.admit(T, 0.0)
    assert permit is not None
    b.record(permit, Verdict.FAILURE, 0.0)
    probe = b.admit(T, 10.0)
    assert probe is not None and probe.probe
    assert [m.to_state for m in b.record(probe, Verdict.SUCCESS, 10.0)] == [State.CLOSED]
    return b


def admitted(b: Breakers, now: float, calls: int) -> int:
    got = 0
    for _ in range(calls):
        permit = b.admit(T, now)
        if permit is not None:
            got += 1
            b.record(permit, Verdict.SUCCESS, now)
    return got


@pytest.mark.parametrize(
    ("after_close", "share"),
    [(0.0, 0.1), (5.0, 0.1), (10.0, 0.1), (25.0, 0.25), (50.0, 0.5), (99.0, 0.99)],
)
def test_the_share_grows_from_a_tenth(after_close: float, share: float) -> None:
    b = recovered()
    assert b.ramp(T, 10.0 + after_close) == pytest.approx(share)
    assert admitted(b, 10.0 + after_close, 1000) == round(1000 * share)


def test_the_ramp_ends_after_ramp_ms() -> None:
    b = recovered()
    assert b.ramp(T, 110.0) is None
    assert admitted(b, 110.0, 50) == 50
    s = b.state(T)
    assert s is not None and s.closed_at is None  # later calls take the plain path


def test_a_failure_during_the_ramp_reopens_at_once() -> None:
    settings = BreakerSettings(
        failure_threshold=5, cooldown_s=10.0, half_open_max_probes=1, success_threshold=1,
        ramp_s=100.0,
    )  # fmt: skip
    b = Breakers({T: settings})
    for now in range(5):
        p = b.admit(T, float(now))
        assert p is not None
        b.record(p, Verdict.FAILURE, float(now))
    probe = b.admit(T, 20.0)
    assert probe is not None
    b.record(probe, Verdict.SUCCESS, 20.0)
    permit = None
    while permit is None:  # the next admitted call of the ramp
        permit = b.admit(T, 30.0)
    moves = b.record(permit, Verdict.FAILURE, 30.0, last_failure="http_503")
    assert [m.to_state for m in moves] == [State.OPEN], "one failure, not five, during a ramp"
    s = b.state(T)
    assert s is not None and s.retry_at == 40.0


def test_without_ramp_ms_a_close_admits_everything() -> None:
    plain = BreakerSettings(
        failure_threshold=1, cooldown_s=10.0, half_open_max_probes=1, success_threshold=1
    )
    b = recovered(plain)
    assert b.ramp(T, 10.0) is None
    assert admitted(b, 10.0, 20) == 20
    s = b.state(T)
    assert s is not None and s.closed_at is None


def test_the_fleets_close_starts_the_ramp_where_it_is_seen() -> None:
    b = Breakers({T: RAMP})
    permit = b.admit(T, 0.0)
    assert permit is not None
    b.record(permit, Verdict.FAILURE, 0.0)
    assert b.force_close(T, 50.0) is not None
    assert b.ramp(T, 60.0) == pytest.approx(0.1)
    assert b.ramp(T, 100.0) == pytest.approx(0.5)


def test_ramp_share_reads_only_closed_states() -> None:
    b = recovered()
    s = b.state(T)
    assert s is not None
    assert ramp_share(s, RAMP, 30.0) == pytest.approx(0.2)
    assert ramp_share(s, RAMP, 9.0) == pytest.approx(0.1)  # (before the close: the floor)

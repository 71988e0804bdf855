"""Operators' overrides in the pure state machine, and the request's checks.

Contract, "The admin port": ``force_open`` is skipped as if open with no probe until
``auto`` or its end; ``force_closed`` is admitted whatever its failures, still counted;
``auto`` is closed with the counts reset. The request's body and token rules are
:mod:`sidecar.override_request` (constant-time comparison, 400 messages).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.breakers.machine import (
    Breakers,
    BreakerSettings,
    Override,
    Permit,
    State,
    Target,
    Verdict,
)
from sidecar.breakers.window import FailureWindow
from sidecar.override_request import BadRequest, admin_token, authorized, parse_body

T = Target("openai", "gpt-4o")
CFG = BreakerSettings(
    failure_threshold=2, cooldown_s=10.0, half_open_max_probes=1, success_threshold=1
)
F, S = Verdict.FAILURE, Verdict.SUCCESS


def ov(action: str, until: float | None = None) -> Override:
    return Override(action, "maintenance", until, None, 1.7e9, "pod-0/1")


def fail(b: Breakers, now: float, n: int = 1) -> None:
    for _ in range(n):
        permit = b.admit(T, now)
        assert permit is not None
        b.record(permit, F, now, last_failure="http_503")


def test_force_open_skips_without_a_probe_ever_and_auto_closes_with_counts_reset() -> None:
    b = Breakers({T: CFG})
    fail(b, 0.0)
    moved = b.override(T, ov("force_open"), 1.0)
    assert moved is not None and (moved.from_state, moved.to_state) == (State.CLOSED, State.OPEN)
    s = b.state(T)
    assert s is not None
    assert (s.state, s.retry_at, s.opened_at, s.consecutive_failures) == (State.OPEN, None, 1.0, 1)
    for now in (1.0, 11.0, 1e6):
        assert b.admit(T, now) is None
        assert b.tick(now) == []
    assert b.next_deadline() is None
    assert b.retry_in([T], 5.0) == 10.0  # no end: one cooldown as the hint
    moved = b.override(T, None, 2.0)
    s = b.state(T)
    assert s is not None and moved is not None
    assert (s.state, s.consecutive_failures, s.override, s.opened_at) == (
        State.CLOSED,
        0,
        None,
        None,
    )
    assert b.admit(T, 2.0) is not None


def test_force_closed_counts_failures_but_never_opens() -> None:
    b = Breakers({T: CFG})
    fail(b, 0.0, 2)
    assert b.state(T).state is State.OPEN  # type: ignore[union-attr]
    b.override(T, ov("force_closed"), 1.0)
    fail(b, 1.0, 5)
    s = b.state(T)
    assert s is not None
    assert (s.state, s.consecutive_failures, s.last_failure) == (State.CLOSED, 7, "http_503")
    permit = b.admit(T, 2.0)
    assert permit is not None
    b.record(permit, S, 2.0)
    assert b.state(T).consecutive_failures == 0  # type: ignore[union-attr]
    b.override(T, None, 3.0)
    fail(b, 3.0, 2)
    assert b.state(T).state is State.OPEN  # type: ignore[union-attr]


def test_force_closed_keeps_a_failure_rate_breaker_closed() -> None:
    cfg = BreakerSettings(
        failure_threshold=100,
        cooldown_s=10.0,
        half_open_max_probes=1,
        success_threshold=1,
        failure_rate=0.5,
        minimum_calls=2,
    )
    window = FailureWindow(60.0)
    b = Breakers({T: cfg}, {T: window})
    b.override(T, ov("force_closed"), 0.0)
    fail(b, 1.0, 4)
    assert b.state(T).state is State.CLOSED  # type: ignore[union-attr]
    b.override(T, None, 2.0)  # auto empties the window: one more failure does not open it
    fail(b, 3.0)
    assert b.state(T).state is State.CLOSED  # type: ignore[union-attr]


def test_an_override_with_an_end_is_on_the_timer_and_ends_as_auto() -> None:
    b = Breakers({T: CFG})
    b.override(T, ov("force_open", until=50.0), 0.0)
    assert b.next_deadline() == 50.0
    assert b.retry_in([T], 20.0) == 30.0
    assert b.expire_overrides(49.9) == []
    [(target, ended, moved)] = b.expire_overrides(50.0)
    assert (target, ended.action) == (T, "force_open")
    assert moved is not None and moved.to_state is State.CLOSED
    assert b.next_deadline() is None
    closed = Breakers({T: CFG})
    closed.override(T, ov("force_closed", until=5.0), 0.0)
    [(_, _, moved)] = closed.expire_overrides(5.0)
    assert moved is None  # closed to closed: no move, the counts reset all the same


def test_permits_from_before_an_override_are_stale() -> None:
    b = Breakers({T: CFG})
    permit = b.admit(T, 0.0)
    assert isinstance(permit, Permit)
    b.override(T, ov("force_closed"), 1.0)
    assert b.record(permit, F, 2.0) == []
    assert b.state(T).consecutive_failures == 0  # type: ignore[union-attr]


def test_a_fleet_close_does_not_end_an_operators_force_open() -> None:
    b = Breakers({T: CFG})
    b.override(T, ov("force_open"), 0.0)
    assert b.force_close(T, 1.0) is None
    assert b.state(T).state is State.OPEN  # type: ignore[union-attr]


def test_restore_carries_an_override_as_it_is() -> None:
    b = Breakers({T: CFG})
    b.override(T, ov("force_open", until=9.0), 0.0)
    c = Breakers({T: CFG})
    c.restore(dict(b.items()))
    assert c.admit(T, 1.0) is None and c.next_deadline() == 9.0


# -- the request ----------------------------------------------------------------------


def test_a_valid_body() -> None:
    got = parse_body({"action": "force_open", "reason": " maintenance ", "for_ms": 600000})
    assert got == ("force_open", "maintenance", 600000)
    assert parse_body({"action": "auto"}) == ("auto", "", None)


@pytest.mark.parametrize(
    "body",
    [
        None,
        "force_open",
        {"action": "open", "reason": "x"},
        {"action": "force_open", "reason": "x" * 501},
        {"action": "force_open", "reason": "x", "for_ms": 365 * 24 * 3600 * 1000 + 1},
        {"action": "force_open", "reason": "x", "extra": 1},
    ],
)
def test_bad_bodies(body: object) -> None:
    with pytest.raises(BadRequest):
        parse_body(body)


def test_token_and_authorization() -> None:
    assert admin_token("", {"": "x"}) is None
    assert admin_token("T", {}) is None
    assert admin_token("T", {"T": ""}) is None
    assert admin_token("T", {"T": "tok"}) == "tok"
    assert authorized("Bearer tok", "tok") and authorized("bearer  tok ", "tok")
    for header in (None, "", "tok", "Bearer", "Bearer tok2", "Basic tok", "Bearer TOK"):
        assert not authorized(header, "tok"), header


TOKENS = st.text(st.characters(blacklist_categories=("Z", "C")), min_size=1, max_size=40)


@given(TOKENS, TOKENS)
def test_only_the_token_itself_is_authorized(token: str, other: str) -> None:
    assert authorized(f"Bearer {token}", token)
    assert authorized(f"Bearer {other}", token) == (other == token)

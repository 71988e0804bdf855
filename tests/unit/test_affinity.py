"""The session table (interface.md, "Choosing among candidates", "Sessions"): its
rules, bound and expiry, and that a header's value is never kept."""

from __future__ import annotations

import pytest

from sidecar.affinity import Sessions, session_key
from sidecar.breakers.types import Target

A, B, C = Target("a", "m"), Target("b", "m"), Target("c", "m")
FIRST = frozenset({A, B})
TTL = 60.0
K = session_key("pool", "conversation-1")


@pytest.mark.parametrize(
    ("kept_to", "served", "refuses", "result", "after"),
    [
        (None, A, False, "new", A),  # placed by balance
        (A, A, False, "kept", A),
        (A, B, False, "kept", A),  # a request-local failure of A: the session stays
        (A, B, True, "moved", B),  # A's breaker refuses now: moves once
        (None, C, False, None, None),  # served by a later tier: not placed
        (A, C, True, None, A),  # A refuses, only the next tier answered: waits for a member
    ],
)
def test_settle(
    kept_to: Target | None, served: Target, refuses: bool, result: str | None, after: Target | None
) -> None:
    s = Sessions()
    if kept_to is not None:
        s.settle(K, None, kept_to, FIRST, False, TTL, 0.0)
    assert s.settle(K, kept_to, served, FIRST, refuses, TTL, 1.0) == result
    assert s.member(K, 2.0) == after


def test_a_moved_session_stays_after_the_first_member_recovers() -> None:
    s = Sessions()
    s.settle(K, None, A, FIRST, False, TTL, 0.0)
    assert s.settle(K, A, B, FIRST, True, TTL, 1.0) == "moved"
    # A is healthy again: the session's requests go to B, which serves them.
    assert s.member(K, 2.0) == B
    assert s.settle(K, B, B, FIRST, False, TTL, 2.0) == "kept"
    assert s.member(K, 3.0) == B


def test_an_unseen_session_is_forgotten_after_its_ttl() -> None:
    s = Sessions()
    s.settle(K, None, A, FIRST, False, TTL, 0.0)
    assert s.member(K, 59.0) == A
    s.settle(K, A, A, FIRST, False, TTL, 59.0)  # seen: the TTL counts from here
    assert s.member(K, 118.0) == A
    assert s.member(K, 119.0) is None
    assert len(s) == 0


def test_the_table_is_bounded_least_recently_used_first_out() -> None:
    s = Sessions(limit=3)
    keys = [session_key("pool", f"s{i}") for i in range(4)]
    for i, k in enumerate(keys[:3]):
        s.settle(k, None, A, FIRST, False, TTL, float(i))
    s.settle(keys[0], A, A, FIRST, False, TTL, 3.0)  # s0 used again: s1 is now the oldest
    s.settle(keys[3], None, B, FIRST, False, TTL, 4.0)
    assert len(s) == 3
    assert s.member(keys[1], 5.0) is None
    assert [s.member(k, 5.0) for k in (keys[0], keys[2], keys[3])] == [A, A, B]


def test_the_key_is_a_keyed_hash_of_route_and_value() -> None:
    k = session_key("pool", "conversation-1")
    assert len(k) == 16 and b"conversation" not in k
    assert k == session_key("pool", "conversation-1")
    assert k != session_key("other", "conversation-1")
    assert k != session_key("pool", "conversation-2")

"""The tier chooser (interface.md, "Choosing among candidates"): shares, weights, the
starvation floor, no pick of a tried or refused member, full members, determinism.

Shares are read from :func:`sidecar.choice.shares` exactly where the rule is a number,
and from draws of a seeded :class:`random.Random` where the rule is about picks.
"""

from __future__ import annotations

from random import Random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.breakers.types import Target
from sidecar.choice import FLOOR, _choose, choose, shares
from sidecar.config import Balance
from sidecar.routes import Candidate
from sidecar.target_stats import TTFO_TAU_S, TargetStats


def member(name: str, weight: float = 1.0) -> Candidate:
    return Candidate(name, "m", Target(name, "m"), weight)


A, B, C = member("a"), member("b"), member("c")
NEVER_FULL = frozenset[str]().__contains__


def bind(tier: list[Candidate], s: dict[Target, TargetStats]) -> list[Candidate]:
    """The members with their targets' statistics bound, as a generation binds them."""
    return [m._replace(stats=s.get(m.target)) for m in tier]


def stats(**per: tuple[int, float | None]) -> dict[Target, TargetStats]:
    """name=(in_flight, ttfo_s) for each target that has statistics."""
    out = {}
    for name, (flight, ttfo) in per.items():
        s = TargetStats()
        s.in_flight, s.ttfo_s = flight, ttfo
        out[Target(name, "m")] = s
    return out


def picks(
    tier: list[Candidate],
    balance: Balance,
    n: int,
    st_: dict[Target, TargetStats] | None = None,
    seed: int = 7,
) -> dict[str, int]:
    rng = Random(seed)
    counts = {m.upstream: 0 for m in tier}
    tier = bind(tier, st_ or {})
    for _ in range(n):
        m = choose(tier, set(), balance, rng.random, NEVER_FULL)
        assert m is not None
        counts[m.upstream] += 1
    return counts


# -- shares as numbers ---------------------------------------------------------------


def test_ordered_takes_the_list_order() -> None:
    tier = [A, B, C]
    assert choose(tier, set(), "ordered", Random(1).random, NEVER_FULL) is A
    assert choose(tier, {A.target}, "ordered", Random(1).random, NEVER_FULL) is B
    assert choose(tier, {A.target, B.target, C.target}, "ordered", Random(1).random,
                  NEVER_FULL) is None  # fmt: skip


def test_weighted_shares_are_the_weights() -> None:
    p = shares([member("a", 2), member("b", 1), member("c", 1)], "weighted")
    assert p == pytest.approx([0.5, 0.25, 0.25])


def test_equally_fast_members_share_by_weight_under_load() -> None:
    # Member a has twice b's weight and, at twice the rate, twice the calls in flight.
    tier = [member("a", 2), member("b", 1)]
    p = shares(bind(tier, stats(a=(8, 0.5), b=(4, 0.5))), "least_loaded")
    rest = 1 - 2 * FLOOR
    assert p == pytest.approx([FLOOR + rest * 2 / 3, FLOOR + rest / 3])


def test_a_member_three_times_slower_gets_at_most_a_quarter() -> None:
    p = shares(bind([A, B], stats(a=(0, 0.4), b=(0, 1.2))), "least_loaded")
    assert p[1] <= 0.25
    p3 = shares(bind([A, B, C], stats(a=(0, 0.4), b=(0, 0.4), c=(0, 1.2))), "least_loaded")
    assert p3[2] <= 0.25


def test_a_very_slow_member_keeps_the_floor() -> None:
    p = shares(bind([A, B], stats(a=(0, 0.1), b=(50, 100.0))), "least_loaded")
    assert p[1] == pytest.approx(FLOOR, rel=1e-3)
    assert p[1] >= FLOOR


def test_a_member_with_no_sample_is_taken_as_fast_as_the_fastest() -> None:
    p = shares(bind([A, B], stats(a=(0, 2.0), b=(0, None))), "least_loaded")
    assert p == pytest.approx([0.5, 0.5])


def test_a_full_member_is_not_picked_while_another_has_room() -> None:
    # Each member's own calls fill its upstream's 4 connections, so its pool is asked.
    s = stats(a=(4, 0.5), b=(4, 0.5))
    for one in s.values():
        one.capacity = 4
    full = frozenset({"a"}).__contains__
    rng = Random(3)
    a, b = bind([A, B], s)
    for _ in range(200):
        assert choose([a, b], set(), "least_loaded", rng.random, full) is b
    # Every member full: the choice goes on among all of them (the pool will queue).
    everyone = frozenset({"a", "b"}).__contains__
    got = {choose([a, b], set(), "least_loaded", rng.random, everyone) for _ in range(200)}
    assert got == {a, b}


def test_the_pool_is_asked_only_when_a_members_calls_reach_its_capacity() -> None:
    s = stats(a=(3, 0.5), b=(0, 0.5))
    for one in s.values():
        one.capacity = 4
    asked: list[str] = []

    def full(upstream: str) -> bool:
        asked.append(upstream)
        return True

    tier = bind([A, B], s)
    choose(tier, set(), "least_loaded", Random(1).random, full)
    assert asked == []
    s[A.target].in_flight = 4
    choose(tier, set(), "least_loaded", Random(1).random, full)
    assert asked == ["a"]


# -- picks ----------------------------------------------------------------------------


def test_picks_follow_the_shares() -> None:
    counts = picks([member("a", 2), member("b", 1)], "weighted", 3000)
    assert 0.62 < counts["a"] / 3000 < 0.71


@pytest.mark.parametrize("balance", ["least_loaded", "weighted"])
def test_picks_draw_by_the_shares_function(balance: Balance) -> None:
    """``choose`` draws in one pass; ``shares`` states the same rule as numbers."""
    tier = [member("a", 2), member("b", 1), member("c", 1)]
    s = stats(a=(3, 0.2), b=(0, 0.6), c=(1, 0.3))
    counts = picks(tier, balance, 20000, s, seed=5)
    for m, p in zip(tier, shares(bind(tier, s), balance), strict=True):
        assert counts[m.upstream] / 20000 == pytest.approx(p, abs=0.015), (m.upstream, p)


def test_the_same_seed_gives_the_same_picks() -> None:
    tier = [A, B, C]
    s = stats(a=(1, 0.3), b=(0, 0.9), c=(2, 0.3))
    assert picks(tier, "least_loaded", 500, s, seed=11) == picks(tier, "least_loaded", 500, s, 11)


@pytest.mark.timeout(60)
@given(
    weights=st.lists(st.floats(0.1, 10), min_size=1, max_size=6),
    flights=st.lists(st.integers(0, 50), min_size=6, max_size=6),
    ttfos=st.lists(st.one_of(st.none(), st.floats(0.001, 100)), min_size=6, max_size=6),
    balance=st.sampled_from(["least_loaded", "weighted", "ordered"]),
    tried_mask=st.integers(0, 63),
    full_mask=st.integers(0, 63),
    seed=st.integers(0, 2**32),
)
def test_any_tier_any_state(
    weights: list[float],
    flights: list[int],
    ttfos: list[float | None],
    balance: Balance,
    tried_mask: int,
    full_mask: int,
    seed: int,
) -> None:
    tier = [member(f"u{i}", w) for i, w in enumerate(weights)]
    s = {m.target: TargetStats() for m in tier}
    full_names = {m.upstream for i, m in enumerate(tier) if full_mask >> i & 1}
    for i, m in enumerate(tier):
        s[m.target].in_flight, s[m.target].ttfo_s = flights[i], ttfos[i]
        if m.upstream in full_names:  # its own calls fill its connections
            s[m.target].in_flight = s[m.target].capacity = max(1, flights[i])
    tried = {m.target for i, m in enumerate(tier) if tried_mask >> i & 1}
    left = [m for m in tier if m.target not in tried]
    if left:
        p = shares(bind(left, s), balance)
        assert sum(p) == pytest.approx(1.0)
        if balance == "least_loaded":
            assert min(p) >= min(FLOOR, 1 / (2 * len(left))) - 1e-12
    got = choose(bind(tier, s), tried, balance, Random(seed).random, full_names.__contains__)
    if not left:
        assert got is None
        return
    assert got is not None and got.target not in tried  # never a tried or refused member
    if balance == "least_loaded" and any(x.upstream not in full_names for x in left):
        assert got.upstream not in full_names
    if balance == "ordered":
        assert got.target == left[0].target


@pytest.mark.timeout(60)
@given(
    weights=st.tuples(st.floats(0.1, 10), st.floats(0.1, 10)),
    flights=st.tuples(st.integers(0, 50), st.integers(0, 50)),
    ttfos=st.tuples(*[st.one_of(st.none(), st.just(0.0), st.floats(0.001, 100))] * 2),
    capacities=st.tuples(st.integers(0, 8), st.integers(0, 8)),
    full_mask=st.integers(0, 3),
    seed=st.integers(0, 2**32),
)
def test_the_two_member_fast_path_picks_as_the_general_rule(
    weights: tuple[float, float],
    flights: tuple[int, int],
    ttfos: tuple[float | None, float | None],
    capacities: tuple[int, int],
    full_mask: int,
    seed: int,
) -> None:
    """``choose``'s straight-line first pick of a two-member ``least_loaded`` tier and
    the general rule (``_choose``) give the same member for the same draws."""
    tier = [member("a", weights[0]), member("b", weights[1])]
    s = {m.target: TargetStats(capacities[i]) for i, m in enumerate(tier)}
    for i, m in enumerate(tier):
        s[m.target].in_flight, s[m.target].ttfo_s = flights[i], ttfos[i]
    full = {m.upstream for i, m in enumerate(tier) if full_mask >> i & 1}.__contains__
    bound = bind(tier, s)
    fast, general = Random(seed), Random(seed)
    for _ in range(20):
        got = choose(bound, set(), "least_loaded", fast.random, full)
        assert got is _choose(bound, set(), "least_loaded", general.random, full)


# -- the time-to-first-output average ----------------------------------------------------


def test_the_average_follows_a_change_of_speed_within_thirty_seconds() -> None:
    s = TargetStats()
    now = 0.0
    for _ in range(100):  # fast for 100 s
        now += 1.0
        s.first_output(0.4, now)
    assert s.ttfo_s == pytest.approx(0.4)
    for _ in range(30):  # then three times slower, one call a second
        now += 1.0
        s.first_output(1.2, now)
    assert s.ttfo_s is not None and s.ttfo_s > 1.19


def test_a_long_gap_takes_the_next_sample_nearly_whole() -> None:
    s = TargetStats()
    s.first_output(0.4, 0.0)
    s.first_output(1.2, 10 * TTFO_TAU_S)
    assert s.ttfo_s == pytest.approx(1.2, rel=1e-3)

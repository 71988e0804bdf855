"""Choosing the next candidate of a route with tiers (pure).

Contract, "Choosing among candidates": candidates with the same ``tier`` are equal
members of it; tiers are tried in ascending order; inside a tier the route's
``balance`` picks per request among the members not tried yet:

- ``ordered``: the list order;
- ``weighted``: at random, in proportion to ``weight``;
- ``least_loaded`` (default): at random, in proportion to an effective weight that
  falls with the member's load and its slowness::

      effective = weight / ((1 + in_flight / weight) * slowness ** 2)

  where ``in_flight`` is its candidate calls in flight and ``slowness`` its recent
  time to first output over the fastest untried member's (1 for the fastest, and for
  a member with no sample yet). Equally fast members get shares in proportion to
  their weights (the ``in_flight / weight`` term keeps the proportion under load); a
  member three times slower than its peer in a two-member tier gets about 12 % of the
  picks with nothing in flight (``1/9`` of the effective weight, plus the floor), and
  more under load, where the faster member holds more calls in flight (16 % with 8
  concurrent streams, ``benchmarks/results/balance.md``): under the contract's quarter.
  It is Envoy's weighted least-request rule (``weight / (active_requests + 1) ^
  active_request_bias``, bias 1) with time to first output added, drawn at random in
  proportion rather than by an earliest-deadline schedule, so that many sidecars do
  not move in step.
  Every member keeps at least :data:`FLOOR` of the picks while it is admitted (so
  its recovery is seen): the share is ``FLOOR`` per member plus the rest in
  proportion to the effective weights.
  A member whose upstream has every connection busy is not picked while another
  untried member has room (its pool is asked when the member's own calls in flight
  reach its upstream's ``max_connections``: an upstream shared with other routes may
  fill up sooner, and such a member is then picked and waits for a connection).

A member the breaker refuses is added to the request's tried set by the caller and
the chooser is asked again: a refused member is never the answer twice. The random
source is injected (a seeded :class:`random.Random` in tests), so picks are
reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol, TypeVar

from sidecar.breakers.types import Target
from sidecar.config import Balance
from sidecar.target_stats import TargetStats

__all__ = ["FLOOR", "Balance", "Member", "choose", "shares"]

FLOOR = 0.02
"""The least share of a tier's picks any admitted member gets (contract: "never less
than 2 %"); with more than 50 members it is ``1 / (2 * members)``."""

M = TypeVar("M", bound="Member")


class Member(Protocol):
    """What the chooser reads of a candidate (:class:`sidecar.routes.Candidate`)."""

    @property
    def upstream(self) -> str: ...

    @property
    def target(self) -> Target: ...

    @property
    def weight(self) -> float: ...

    @property
    def stats(self) -> TargetStats | None: ...


def _floor(n: int) -> float:
    """Each of ``n`` members' least share: :data:`FLOOR`, or ``1 / (2 n)`` past 25 members."""
    return FLOOR if n * FLOOR <= 0.5 else 1.0 / (2 * n)


def shares(members: Sequence[Member], balance: Balance) -> list[float]:
    """Each member's probability of being picked (summing to 1), by ``balance``.

    :param members: the untried members with room, at least one; a member whose
        ``stats`` is None has no load and no sample.
    """
    n = len(members)
    if balance == "ordered":
        return [1.0] + [0.0] * (n - 1)
    if balance == "weighted":
        total = sum(m.weight for m in members)
        return [m.weight / total for m in members]
    eff = _effective(members)
    total = sum(eff)
    floor = _floor(n)
    rest = (1.0 - n * floor) / total
    return [floor + rest * e for e in eff]


def _effective(members: Sequence[Member]) -> list[float]:
    """``least_loaded``'s effective weight of each member (see the module docstring), up
    to a common factor: ``weight / ((1 + in_flight / weight) * ttfo ** 2)``, the fastest
    member's ``ttfo ** 2`` dividing out of every share; a member with no sample (or no
    statistics) is taken as fast as the fastest, and with no sample at all every
    ``ttfo`` counts as 1."""
    eff = []
    missing = False
    for m in members:
        w = m.weight
        s = m.stats
        if s is None or s.ttfo_s is None:
            missing = True
            eff.append(-1.0)  # filled in below
        else:
            t = s.ttfo_s or 1e-9
            eff.append(w / ((1.0 + s.in_flight / w) * t * t))
    if missing:  # rare: a member before its first answer
        known = [
            s.ttfo_s or 1e-9 for m in members if (s := m.stats) is not None and s.ttfo_s is not None
        ]
        fastest = min(known, default=1.0)
        for i, m in enumerate(members):
            if eff[i] < 0:
                s = m.stats
                w = m.weight
                flight = 0 if s is None else s.in_flight
                eff[i] = w / ((1.0 + flight / w) * fastest * fastest)
    return eff


def _at_capacity(s: TargetStats | None) -> bool:
    return s is not None and 0 < s.capacity <= s.in_flight


def choose(
    tier: Sequence[M],
    tried: Collection[Target],
    balance: Balance,
    draw: Callable[[], float],
    full: Callable[[str], bool],
) -> M | None:
    """The next member of ``tier`` to try, or None when every member was tried.

    :param tried: targets this request has tried or had refused (by their breaker).
    :param draw: a uniform random number in [0, 1) (``random.Random.random``).
    :param full: whether an upstream has every one of its ``max_connections`` busy
        (read by ``least_loaded`` only).
    :returns: a member not in ``tried`` (with ``least_loaded``, one with room when any
        has room).
    """
    # The common case in straight lines: least_loaded's first pick in a two-member
    # tier whose members both have a sample and room. No list, no loop, no call: under
    # half of the general path's instructions (benchmarks/results/instructions-tier-22b.md),
    # and the same pick for the same draw (tests/unit/test_choice.py).
    if not tried and balance == "least_loaded" and len(tier) == 2:
        a, b = tier
        sa, sb = a.stats, b.stats
        if sa is not None and sb is not None:
            ta, tb, fa, fb = sa.ttfo_s, sb.ttfo_s, sa.in_flight, sb.in_flight
            if ta and tb and not (0 < sa.capacity <= fa) and not (0 < sb.capacity <= fb):
                wa, wb = a.weight, b.weight
                ea = wa / ((1.0 + fa / wa) * ta * ta)
                eb = wb / ((1.0 + fb / wb) * tb * tb)
                x = draw()
                if x < 2 * FLOOR:
                    return tier[int(x / FLOOR)]
                return a if (x - 2 * FLOOR) / (1.0 - 2 * FLOOR) * (ea + eb) - ea < 0 else b
    return _choose(tier, tried, balance, draw, full)


def _choose(
    tier: Sequence[M],
    tried: Collection[Target],
    balance: Balance,
    draw: Callable[[], float],
    full: Callable[[str], bool],
) -> M | None:
    """:func:`choose` in general (any tier, any state)."""
    left = [m for m in tier if m.target not in tried] if tried else tier
    if len(left) <= 1 or balance == "ordered":
        return left[0] if left else None
    if balance == "weighted":
        x = draw() * sum(m.weight for m in left)
        for m in left:
            x -= m.weight
            if x < 0:
                return m
        return left[-1]
    # least_loaded: a member whose own calls fill its upstream's connections is full
    # when its pool says so (asked only then); the others are picked among first.
    busy = [m for m in left if _at_capacity(m.stats) and full(m.upstream)]
    if busy and len(busy) < len(left):
        left = [m for m in left if m not in busy]
        if len(left) == 1:
            return left[0]
    eff = _effective(left)
    n = len(left)
    floor = _floor(n)
    # Draw once: the first n * floor of [0, 1) is the floor, shared evenly; the rest
    # goes in proportion to the effective weights.
    x = draw()
    if x < n * floor:
        return left[int(x / floor)]
    x = (x - n * floor) / (1.0 - n * floor) * sum(eff)
    for m, e in zip(left, eff):  # noqa: B905  (same length by construction)
        x -= e
        if x < 0:
            return m
    return left[-1]

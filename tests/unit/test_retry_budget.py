"""The retry budget's arithmetic (:mod:`sidecar.retry_budget`) and the backoff's full
jitter (:meth:`sidecar.upstream.Upstream.retry_wait`): tables, no IO."""

from __future__ import annotations

from random import Random

import pytest

from sidecar.config import parse_config
from sidecar.outcome import UpstreamConnectError, UpstreamTimeout
from sidecar.retry_budget import RetryBudget
from sidecar.upstream import Upstream
from tests.configs import single

# (budget_percent, min_retry_concurrency, requests in flight, retries in flight, allowed)
BUDGET_TABLE = [
    # the minimum alone: a quiet upstream may still retry up to min_retry_concurrency
    (20, 3, 1, 0, True),
    (20, 3, 1, 2, True),
    (20, 3, 1, 3, False),
    (20, 3, 10, 2, True),  # 20 % of 10 = 2 < 3: the minimum decides
    (20, 3, 10, 3, False),
    # the share: 20 % of 100 = 20 retries in flight
    (20, 3, 100, 19, True),
    (20, 3, 100, 20, False),  # "fewer than": 20 is the limit, not allowed
    (20, 3, 101, 20, True),  # 20.2 > 20
    (50, 1, 10, 4, True),
    (50, 1, 10, 5, False),
    (50, 1, 9, 4, True),  # 4 < 4.5
    (50, 1, 9, 5, False),
    # zero settings
    (0, 0, 100, 0, False),  # no budget at all: never a retry
    (0, 3, 100, 2, True),
    (0, 3, 100, 3, False),
    (100, 0, 4, 3, True),
    (100, 0, 4, 4, False),
    (100, 0, 0, 0, False),  # nothing in flight and no minimum
    (12.5, 0, 16, 1, True),  # a fractional percent: 2 of 16
    (12.5, 0, 16, 2, False),
]


@pytest.mark.parametrize(("percent", "minimum", "requests", "retries", "allowed"), BUDGET_TABLE)
def test_budget_allows_fewer_than_the_larger_of_the_minimum_and_the_share(
    percent: float, minimum: int, requests: int, retries: int, allowed: bool
) -> None:
    budget = RetryBudget(percent, minimum)
    budget.requests, budget.retries = requests, retries
    assert budget.allows() is allowed
    assert budget.take() is allowed
    assert budget.retries == retries + (1 if allowed else 0)  # counted only when granted


def test_take_counts_until_given_back() -> None:
    budget = RetryBudget(20, 3)
    budget.requests = 10
    assert [budget.take() for _ in range(4)] == [True, True, True, False]
    assert budget.retries == 3
    budget.give_back()
    assert budget.retries == 2
    assert budget.take() is True
    budget.requests = 20  # 20 % of 20 = 4 > 3
    assert budget.take() is True
    assert budget.take() is False


def wait(up: Upstream, retried: int) -> float:
    """The wait before a retried status's next attempt (one is due)."""
    w = up.retry_wait(retried, None, True, None)
    assert w is not None
    return w


def upstream(draw: Random | None = None, **retry: object) -> Upstream:
    keys = {"max_retries": 3, "backoff_initial_ms": 250, "backoff_max_ms": 2000, **retry}
    cfg = parse_config(single("http://127.0.0.1:1", retry=keys), {})
    return Upstream(
        "primary", cfg.upstreams["primary"], None, None, None if draw is None else draw.random
    )


def test_jitter_off_waits_the_exponential_schedule() -> None:
    up = upstream(jitter=False)
    waits = [up.retry_wait(n, UpstreamConnectError("x"), False, None) for n in range(3)]
    assert waits == [0.25, 0.5, 1.0]


def test_full_jitter_draws_each_wait_from_zero_to_the_backoff() -> None:
    """Each wait is the backoff times one draw of the injected source, in order."""
    up = upstream(Random(42))
    waits = [wait(up, n) for n in range(3)]
    draws = Random(42)
    assert waits == [0.25 * draws.random(), 0.5 * draws.random(), 1.0 * draws.random()]
    assert waits != [0.25, 0.5, 1.0]
    assert all(0.0 <= w < b for w, b in zip(waits, [0.25, 0.5, 1.0], strict=True))


def test_jitter_is_on_by_default_and_spreads_the_waits() -> None:
    up = upstream(Random(1))
    waits = {wait(up, 0) for _ in range(200)}
    assert len(waits) == 200  # no two retries of a fleet in lockstep
    assert min(waits) < 0.05 and max(waits) > 0.2  # spread over [0, 0.25)


def test_retry_after_is_waited_as_it_came_with_jitter_on() -> None:
    up = upstream(Random(0), retry_after_max_ms=5000)
    assert up.retry_wait(0, None, True, 3.0) == 3.0
    assert up.retry_wait(0, None, True, 6.0) is None  # longer than the cap: fall back now


def test_no_draw_when_no_retry_is_due() -> None:
    """A wait is drawn only for a retry that is due (the seeded sequence is not used up
    by answers that are not retried)."""
    draws = Random(5)
    up = upstream(draws)
    before = draws.getstate()
    assert up.retry_wait(3, None, True, None) is None  # max_retries reached
    assert up.retry_wait(0, None, False, None) is None  # a status not retried
    assert up.retry_wait(0, UpstreamTimeout("t"), False, None) is None  # retry_on_timeout off
    assert draws.getstate() == before

"""The breakers of (target, credential), as tables (interface.md, "Bounding the load that
failures add"; rules in :mod:`sidecar.breakers.credentials`).

Each row is a script of calls on one :class:`CredentialBreakers` (admit, settle with a
verdict, release, tick) and what the table must say after it: the state of each
credential's breaker (or none kept), how many are held, and what an admission returns.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from sidecar.breakers.credentials import (
    CredentialBreakers,
    credential_key,
    credential_of,
    short,
)
from sidecar.breakers.types import BreakerSettings, CredentialPermit, State, Target, Verdict

T = Target("openai", "*")
U = Target("anthropic", "*")
NO_SCOPE = Target("pinned", "*")  # a target with a breaker and rate_limit_scope = "target"
CFG = BreakerSettings(
    failure_threshold=3,
    cooldown_s=10.0,
    half_open_max_probes=1,
    success_threshold=1,
    window_s=60.0,
    failure_rate=0.5,  # the target's: never used by a credential breaker
    ramp_s=30.0,  # idem
)
A, B = credential_key("Bearer A"), credential_key("Bearer B")
S, F, N = Verdict.SUCCESS, Verdict.FAILURE, Verdict.NEUTRAL
CLOSED, OPEN, HALF = State.CLOSED, State.OPEN, State.HALF_OPEN


class Admit(NamedTuple):
    """Admit ``key`` at ``now``; ``expect``: "permit", "probe" or "skip"."""

    key: bytes
    now: float
    expect: str


class Settle(NamedTuple):
    """Admit ``key`` at ``now`` and settle the call with ``verdict`` (``rl``: a rate limit)."""

    key: bytes
    now: float
    verdict: Verdict
    rl: bool = True
    retry_after: float | None = None


class Tick(NamedTuple):
    now: float


Step = Admit | Settle | Tick


def make(limit: int = 10_000) -> CredentialBreakers:
    return CredentialBreakers(
        {T: CFG, U: CFG, NO_SCOPE: CFG}, {T: "authorization", U: "x-api-key"}, limit
    )


def run(cb: CredentialBreakers, steps: list[Step], target: Target = T) -> None:
    for step in steps:
        if isinstance(step, Tick):
            cb.tick(step.now)
            continue
        permit, _ = cb.admit(target, step.key, step.now)
        if isinstance(step, Admit):
            got = "skip" if permit is None else ("probe" if permit.probe else "permit")
            assert got == step.expect, step
            if permit is not None:
                cb.release(target, permit)
            continue
        assert permit is not None, step
        cb.record(
            target,
            permit,
            step.verdict,
            step.now,
            rate_limit=step.rl,
            last_failure="http_429" if step.rl else "http_503",
            retry_after_s=step.retry_after,
        )


def rl(key: bytes, now: float, retry_after: float | None = None) -> Settle:
    return Settle(key, now, F, True, retry_after)


class Row(NamedTuple):
    name: str
    steps: list[Step]
    a: tuple[State, int] | None  # A's (state, consecutive failures), None: none kept
    b: tuple[State, int] | None = None
    held: int | None = None  # None: count the rows' kept breakers


ROWS = [
    Row("one 429 counts, kept closed", [rl(A, 1)], (CLOSED, 1)),
    Row("three 429s open A only", [rl(A, 1), rl(A, 2), rl(A, 3)], (OPEN, 3)),
    Row("a non-rate-limit failure is neutral here", [Settle(A, 1, F, rl=False)] * 3, None),
    Row("neutral is neutral", [rl(A, 1), Settle(A, 2, N)], (CLOSED, 1)),
    Row("a success forgets the count", [rl(A, 1), rl(A, 2), Settle(A, 3, S)], None),
    Row("B's success leaves A's count", [rl(A, 1), rl(A, 2), Settle(B, 3, S)], (CLOSED, 2)),
    Row("B's 429 counts for B", [rl(A, 1), rl(A, 2), rl(B, 3)], (CLOSED, 2), (CLOSED, 1)),
    Row(
        "open A skips A, admits B",
        [rl(A, 1), rl(A, 2), rl(A, 3), Admit(A, 4, "skip"), Admit(B, 4, "permit")],
        (OPEN, 3),
    ),
    Row(
        "cooldown over: one probe, a second waits",
        [rl(A, 1), rl(A, 2), rl(A, 3), Admit(A, 13, "probe")],
        (HALF, 3),
    ),
    Row(
        "probe success closes and forgets",
        [rl(A, 1), rl(A, 2), rl(A, 3), Settle(A, 13, S), Admit(A, 13, "permit")],
        None,
    ),
    Row(
        "probe 429 opens again",
        [rl(A, 1), rl(A, 2), rl(A, 3), rl(A, 13), Admit(A, 14, "skip"), Admit(A, 22.5, "skip")],
        (OPEN, 4),
    ),
    Row(
        "probe 503 (not a rate limit) frees the slot, stays half-open",
        [rl(A, 1), rl(A, 2), rl(A, 3), Settle(A, 13, F, rl=False), Admit(A, 14, "probe")],
        (HALF, 3),
    ),
    Row(
        "Retry-After opens longer than the cooldown",
        [
            rl(A, 1),
            rl(A, 2),
            rl(A, 3, retry_after=30.0),
            Admit(A, 20, "skip"),
            Admit(A, 33, "probe"),
        ],
        (HALF, 3),
    ),
    Row(
        "tick moves a due one to half-open",
        [rl(A, 1), rl(A, 2), rl(A, 3), Tick(12.9), Tick(13)],
        (HALF, 3),
    ),
    Row(
        "a closed one is forgotten window_s after its last 429",
        [rl(A, 1), rl(A, 2), Tick(62)],
        None,
    ),
    Row("... not before", [rl(A, 1), rl(A, 2), Tick(61)], (CLOSED, 2)),
    Row(
        "an open one nobody probes is forgotten window_s after retry_at",
        [rl(A, 1), rl(A, 2), rl(A, 3), Admit(B, 73, "permit")],
        None,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_credential_breaker_rows(row: Row) -> None:
    cb = make()
    run(cb, row.steps)
    for key, want in ((A, row.a), (B, row.b)):
        st = cb.state(T, key)
        assert (None if st is None else (st.state, st.consecutive_failures)) == want
    kept = sum(1 for w in (row.a, row.b) if w is not None)
    assert cb.held == (kept if row.held is None else row.held)
    assert cb.holds(T) is (kept > 0)


def test_target_scope_and_other_targets_have_no_credential_breakers() -> None:
    cb = make()
    assert cb.header(T) == "authorization" and cb.header(U) == "x-api-key"
    assert cb.header(NO_SCOPE) is None and cb.header(Target("nobreaker", "*")) is None
    run(cb, [rl(A, 1), rl(A, 2), rl(A, 3)], target=NO_SCOPE)
    assert cb.held == 0 and cb.state(NO_SCOPE, A) is None
    run(cb, [rl(A, 1), rl(A, 2), rl(A, 3)], target=U)  # per target
    assert cb.state(U, A) is not None and cb.state(T, A) is None and not cb.holds(T)


def test_stale_permits_change_nothing() -> None:
    cb = make()
    old = [cb.admit(T, A, 1)[0] for _ in range(4)]  # four calls in flight, closed
    for p in old[:3]:
        assert p is not None
        cb.record(T, p, F, 2, rate_limit=True)
    st = cb.state(T, A)
    assert st is not None and st.state is OPEN
    assert old[3] is not None
    assert cb.record(T, old[3], S, 3, rate_limit=False) == []  # issued closed: stale now
    assert cb.state(T, A) == st
    cb.record(T, old[3], F, 3, rate_limit=True, retry_after_s=50.0)  # extends, never shortens
    extended = cb.state(T, A)
    assert extended is not None and extended.retry_at == 53.0
    cb.record(T, old[3], F, 3, rate_limit=True, retry_after_s=1.0)
    assert cb.state(T, A) == extended
    # a probe permit whose breaker was forgotten meanwhile changes nothing
    assert cb.record(T, CredentialPermit(B, 7, True), F, 4, rate_limit=True) == []
    assert cb.state(T, B) is None


def test_moves_are_returned_once() -> None:
    cb = make()
    moves = []
    for now in (1, 2, 3):
        p, _ = cb.admit(T, A, now)
        assert p is not None
        moves += cb.record(T, p, F, now, rate_limit=True, last_failure="http_429")
    assert [(m.from_state, m.to_state, m.key) for m in moves] == [(CLOSED, OPEN, A)]
    assert moves[0].state.last_failure == "http_429" and moves[0].state.retry_at == 13.0
    p, due = cb.admit(T, A, 14)
    assert [(m.from_state, m.to_state) for m in due] == [(OPEN, HALF)]
    assert p is not None and p.probe
    assert cb.admit(T, A, 14) == (None, [])  # the one slot is taken
    assert cb.retry_in(T, A, 14) is None
    closed = cb.record(T, p, S, 15, rate_limit=False)
    assert [(m.from_state, m.to_state) for m in closed] == [(HALF, CLOSED)]
    assert cb.held == 0 and cb.retry_in(T, A, 15) == 0.0


def test_release_frees_a_probe_slot() -> None:
    cb = make()
    run(cb, [rl(A, 1), rl(A, 2), rl(A, 3)])
    assert cb.retry_in(T, A, 5) == 8.0
    p, _ = cb.admit(T, A, 13)
    assert p is not None and p.probe and cb.admit(T, A, 13)[0] is None
    cb.release(T, p)
    again, _ = cb.admit(T, A, 13)
    assert again is not None and again.probe


def test_bound_forgets_closed_ones_first() -> None:
    cb = make(limit=3)
    keys = [credential_key(f"Bearer k{i}") for i in range(5)]
    run(cb, [rl(keys[0], 1), rl(keys[0], 2), rl(keys[0], 3)])  # k0 open
    run(cb, [rl(keys[1], 4), rl(keys[2], 5), rl(keys[3], 6)])  # three closed, counting
    assert cb.held == 3
    assert cb.state(T, keys[0]) is not None  # the open one stays: k1 (oldest closed) went
    assert cb.state(T, keys[1]) is None and cb.state(T, keys[3]) is not None
    # three open ones fill the table: a new credential's first 429 is the closed one, the
    # first to go; the open ones stay
    for k in (keys[2], keys[3]):
        run(cb, [rl(k, 7), rl(k, 8)])
    states = [cb.state(T, k) for k in keys[:4]]
    assert [None if st is None else st.state for st in states] == [OPEN, None, OPEN, OPEN]
    assert cb.held == 3
    run(cb, [rl(keys[4], 9)])
    assert cb.state(T, keys[4]) is None and cb.held == 3


def test_keys_are_keyed_hashes() -> None:
    assert A != B and len(A) == 16 and credential_key("Bearer A") == A
    assert b"Bearer A" not in A
    assert len(short(A)) == 8 and A.hex().startswith(short(A))


@pytest.mark.parametrize(
    ("headers", "header", "expected"),
    [
        ({"authorization": "Bearer k1"}, "authorization", "k1"),
        ({"x-api-key": "k1"}, "x-api-key", "k1"),
        ({"authorization": "bearer  k1"}, "x-api-key", "k1"),  # the SDK sent another header
        ({"api-key": "k1", "x-api-key": "k2"}, "authorization", "k2"),  # in a fixed order
        ({"x-api-key": "k1", "authorization": "Bearer k2"}, "x-api-key", "k1"),  # configured first
        ({"authorization": "Basic dXNlcg=="}, "authorization", "Basic dXNlcg=="),
        ({}, "authorization", ""),  # no credential: one shared "caller"
    ],
)
def test_the_credential_of_a_request(headers: dict[str, str], header: str, expected: str) -> None:
    assert credential_of(headers, header) == expected

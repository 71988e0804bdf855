"""Random admit / record / release / advance-time sequences against a reference model.

The model below is written from interface.md ("The circuit breaker") on its own,
with plain mutable fields and no generation arithmetic shared with the code under
test: a permit is stale when the model's breaker has changed mode since it was
handed out. After every step the two must agree, and:

- probes in flight stay within 0..half_open_max_probes, and equal the number of
  unsettled current probe permits (so no permit leaks a slot);
- a stale result changes nothing but a Retry-After extension of an open breaker;
- every transition is handed out once, by ``record``, ``tick`` or (for the
  open -> half_open move that ``admit`` makes when the timer is late)
  ``drain_transitions``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
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

TARGETS = (Target("a", "*"), Target("b", "m"))
START = 1000.0
# Mostly the first target, so that held permits often see their breaker move on.
target_st = st.sampled_from([TARGETS[0], TARGETS[0], TARGETS[0], TARGETS[1]])

settings_st = st.builds(
    BreakerSettings,
    failure_threshold=st.integers(1, 3),
    cooldown_s=st.sampled_from([1.0, 2.5, 5.0]),
    half_open_max_probes=st.integers(1, 3),
    success_threshold=st.integers(1, 3),
)
retry_after_st = st.none() | st.sampled_from([0.0, 2.0, 10.0, 30.0])
failure_st = st.sampled_from(["connect_error", "timeout", "http_503"])
# Failures are drawn more often, so breakers open and probe often enough.
VERDICTS = [Verdict.FAILURE, Verdict.FAILURE, Verdict.SUCCESS, Verdict.NEUTRAL]
verdict_st = st.sampled_from(VERDICTS)
settle_st = st.sampled_from([None, *VERDICTS])  # None: release instead


class Model:
    """One breaker, the simple way: a mode string and counters."""

    def __init__(self, cfg: BreakerSettings) -> None:
        self.cfg = cfg
        self.mode = "closed"
        self.changes = 0  # mode changes so far; a permit from an older count is stale
        self.fails = 0
        self.wins = 0
        self.probes = 0
        self.opened: float | None = None
        self.until: float | None = None
        self.last: str | None = None

    def _go(self, mode: str) -> tuple[str, str]:
        move = (self.mode, mode)
        self.mode = mode
        self.changes += 1
        self.wins = 0
        self.probes = 0
        return move

    def _open(self, now: float, retry_after: float | None) -> tuple[str, str]:
        self.opened = now
        wait = self.cfg.cooldown_s
        if retry_after is not None and retry_after > wait:
            wait = retry_after
        self.until = now + wait
        return self._go("open")

    def wake(self, now: float) -> list[tuple[str, str]]:
        """The open period has ended: half-open (the timer, or admit when it is late)."""
        if self.mode == "open" and self.until is not None and now >= self.until:
            return [self._go("half_open")]
        return []

    def admit(self, now: float) -> tuple[int, bool] | None:
        if self.mode == "closed":
            return (self.changes, False)
        if self.mode == "half_open" and self.probes < self.cfg.half_open_max_probes:
            self.probes += 1
            return (self.changes, True)
        return None

    def extend(self, retry_after: float, now: float) -> None:
        if self.mode == "open" and self.until is not None and now < self.until:
            self.until = max(self.until, now + retry_after)

    def settle(
        self, changes: int, verdict: Verdict, now: float, retry_after: float | None, last: str
    ) -> list[tuple[str, str]]:
        if self.mode == "open" and verdict is Verdict.FAILURE and retry_after is not None:
            self.extend(retry_after, now)
        if changes != self.changes or self.mode == "open":
            return []
        if self.mode == "half_open":
            self.probes -= 1
        if verdict is Verdict.FAILURE:
            self.fails += 1
            self.last = last
            if self.mode == "half_open" or self.fails >= self.cfg.failure_threshold:
                return [self._open(now, retry_after)]
        elif verdict is Verdict.SUCCESS and self.mode == "closed":
            self.fails = 0
        elif verdict is Verdict.SUCCESS:
            self.wins += 1
            if self.wins >= self.cfg.success_threshold:
                self.fails = 0
                self.opened = self.until = None
                return [self._go("closed")]
        return []

    def release(self, changes: int, probe: bool) -> None:
        if probe and changes == self.changes and self.mode == "half_open":
            self.probes -= 1


@dataclass
class Outstanding:
    permit: Permit
    changes: int  # the model's change count when it was handed out
    probe: bool


def moves_of(transitions: list[Transition]) -> list[tuple[Target, str, str]]:
    return [(t.target, t.from_state.value, t.to_state.value) for t in transitions]


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = START
        self.models: dict[Target, Model] = {}
        self.outstanding: list[Outstanding] = []

    @initialize(a=settings_st, b=settings_st)
    def setup(self, a: BreakerSettings, b: BreakerSettings) -> None:
        self.sut = Breakers(dict(zip(TARGETS, (a, b), strict=True)))
        self.models = dict(zip(TARGETS, (Model(a), Model(b)), strict=True))

    @rule(tgt=target_st)
    def admit(self, tgt: Target) -> None:
        """Hand out a permit (or not) and hold it; moves made by admit are drained."""
        model = self.models[tgt]
        expected_moves = [(tgt, *m) for m in model.wake(self.now)]
        expected = model.admit(self.now)
        permit = self.sut.admit(tgt, self.now)
        assert moves_of(self.sut.drain_transitions()) == expected_moves
        if expected is None:
            assert permit is None
            return
        assert permit is not None and permit.target == tgt
        assert permit.probe == expected[1]
        self.outstanding.append(Outstanding(permit, expected[0], expected[1]))

    @precondition(lambda self: self.outstanding)
    @rule(
        index=st.integers(0, 50),
        verdict=settle_st,
        retry_after=retry_after_st,
        last=failure_st,
    )
    def settle(
        self, index: int, verdict: Verdict | None, retry_after: float | None, last: str
    ) -> None:
        """Settle a held permit: ``record`` its verdict, or ``release`` it (verdict None)."""
        out = self.outstanding.pop(index % len(self.outstanding))
        target = out.permit.target
        model = self.models[target]
        stale = out.changes != model.changes
        before = self.sut.state(target)
        if verdict is None:
            model.release(out.changes, out.probe)
            self.sut.release(out.permit)
        else:
            settled = model.settle(out.changes, verdict, self.now, retry_after, last)
            got = self.sut.record(
                out.permit, verdict, self.now, last_failure=last, retry_after_s=retry_after
            )
            assert moves_of(got) == [(target, *m) for m in settled]
            assert all(t.state == self.sut.state(target) for t in got)
        if stale:
            self.check_unchanged(before, self.sut.state(target), verdict, retry_after)

    def check_unchanged(
        self,
        before: BreakerState | None,
        after: BreakerState | None,
        verdict: Verdict | None,
        retry_after: float | None,
    ) -> None:
        """A stale result changes nothing but an open breaker's retry_at (extended)."""
        assert before is not None and after is not None
        if before.state is State.OPEN and verdict is Verdict.FAILURE and retry_after is not None:
            assert before.retry_at is not None and after.retry_at is not None
            assert after.retry_at in (before.retry_at, self.now + retry_after)
            assert after.retry_at >= before.retry_at
            after = replace(after, retry_at=before.retry_at)
        assert after == before, "a stale result changed the state"

    def _call(self, tgt: Target, verdict: Verdict, retry_after: float | None, last: str) -> bool:
        """A whole call: admit, and if admitted record its verdict at once."""
        held = len(self.outstanding)
        self.admit(tgt)
        if len(self.outstanding) == held:
            return False
        self.settle(-1, verdict, retry_after, last)
        return True

    @rule(tgt=target_st, verdict=verdict_st, retry_after=retry_after_st)
    def call(self, tgt: Target, verdict: Verdict, retry_after: float | None) -> None:
        self._call(tgt, verdict, retry_after, "http_503")

    # Two shortcuts through a whole cycle, so that permits held across it turn stale:
    # with ``hold``, one call is admitted first and stays in flight (held).

    @rule(tgt=target_st, retry_after=retry_after_st, last=failure_st, hold=st.booleans())
    def trip(self, tgt: Target, retry_after: float | None, last: str, hold: bool) -> None:
        """Fail fresh calls until the breaker opens (or no call is admitted)."""
        if hold:
            self.admit(tgt)
        model = self.models[tgt]
        while model.mode != "open" and self._call(tgt, Verdict.FAILURE, retry_after, last):
            pass

    @rule(tgt=target_st, close=st.booleans(), hold=st.booleans())
    def cool_down(self, tgt: Target, close: bool, hold: bool) -> None:
        """Run time to an open breaker's retry_at, fire the timer; then maybe close it."""
        model = self.models[tgt]
        if model.mode == "open" and model.until is not None:
            self.now = max(self.now, model.until)
            self.advance(0.0, fire=True)
        if hold:
            self.admit(tgt)
        while close and model.mode == "half_open" and self._call(tgt, Verdict.SUCCESS, None, ""):
            pass

    @rule(tgt=target_st, retry_after=st.sampled_from([0.5, 2.0, 10.0]))
    def note_retry_after(self, tgt: Target, retry_after: float) -> None:
        self.models[tgt].extend(retry_after, self.now)
        self.sut.note_retry_after(tgt, retry_after, self.now)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 5.0, 10.0]), fire=st.booleans())
    def advance(self, dt: float, fire: bool) -> None:
        """Time passes; the timer fires (tick) or is late (admit then makes the move)."""
        self.now += dt
        if fire:
            expected = [(t, *m) for t, model in self.models.items() for m in model.wake(self.now)]
            assert sorted(moves_of(self.sut.tick(self.now))) == sorted(expected)

    @invariant()
    def agrees_with_model(self) -> None:
        for target, model in self.models.items():
            s = self.sut.state(target)
            assert s is not None
            assert s.state.value == model.mode
            assert s.consecutive_failures == model.fails
            assert s.probe_successes == model.wins
            assert s.probes_in_flight == model.probes
            assert s.retry_at == model.until
            assert s.opened_at == model.opened
            assert s.last_failure == model.last

    @invariant()
    def probes_within_bounds_and_accounted(self) -> None:
        for target, model in self.models.items():
            s = self.sut.state(target)
            assert s is not None
            assert 0 <= s.probes_in_flight <= model.cfg.half_open_max_probes
            held = sum(
                1
                for o in self.outstanding
                if o.permit.target == target and o.probe and o.permit.generation == s.generation
            )
            assert s.probes_in_flight == (held if s.state is State.HALF_OPEN else 0)

    @invariant()
    def next_deadline_is_soonest_open(self) -> None:
        opens = [m.until for m in self.models.values() if m.mode == "open" and m.until is not None]
        assert self.sut.next_deadline() == min(opens, default=None)

    def teardown(self) -> None:
        """Settle every held permit: then no probe slot may still be taken (no leak)."""
        if not self.models:
            return
        while self.outstanding:
            self.settle(0, None, None, "")
        for target in TARGETS:
            state = self.sut.state(target)
            assert state is not None and state.probes_in_flight == 0


# No explain phase and one bug per run: a failure shrinks well inside the 30 s timeout.
BreakerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    report_multiple_bugs=False,
)
TestBreakerMachine = BreakerMachine.TestCase

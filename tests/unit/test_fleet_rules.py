"""The fleet's pure rules, from tables (interface.md, "The fleet: breakers shared through Redis").

What a member publishes, when quorum makes the record open, half_open by time, the
lease, close propagation, expiry, the store's health lines; plus ``[fleet]``'s config
and its URL variable. No Redis, no event loop.
"""

from __future__ import annotations

import pytest

from sidecar.breakers.machine import Breakers, BreakerSettings, State, Target, Verdict
from sidecar.config import ConfigError, parse_config
from sidecar.fleet import (
    Admission,
    Close,
    FleetState,
    LeaseOutcome,
    Record,
    Report,
    StoreHealth,
    TargetView,
    admission,
    after_lease,
    after_probe,
    close_applies,
    fleet_env_problems,
    live_members,
    member_name,
    missing_reports,
    quorum_record,
    record_state,
    record_ttl_s,
)
from sidecar.fleet.store import Keys

T = Target("openai", "gpt-4o")
CD = 30.0  # cooldown, s
NOW = 1000.0
REC = Record("open", 990.0, 1010.0, "http_503", "pod-a/1")
PROBED = Record("open", 990.0, 1010.0, "http_503", "pod-a/1", probe_until=1070.0)


A_1030 = Record("open", NOW, 1030, "http_503", "me")


def rep(member: str, retry_at: float, last: str | None = "http_503") -> Report:
    return Report(member, retry_at, last)


@pytest.mark.parametrize(
    ("record", "now", "state"),
    [
        (None, NOW, FleetState.NONE),
        (REC, 1009.999, FleetState.OPEN),
        (REC, 1010.0, FleetState.HALF_OPEN),  # the open period ended: one probe
        (REC, 1039.999, FleetState.HALF_OPEN),
        (REC, 1040.0, FleetState.NONE),  # nobody probed: expired one cooldown after half_open
        (PROBED, 1009.0, FleetState.OPEN),
        (PROBED, 1060.0, FleetState.HALF_OPEN),  # a probe holds the lease: still half_open
        (PROBED, 1070.0, FleetState.NONE),  # its lease has expired too
    ],
)
def test_record_state_by_time(record: Record | None, now: float, state: FleetState) -> None:
    assert record_state(record, now, CD) is state


def test_the_record_lives_until_one_cooldown_after_it_turns_half_open() -> None:
    assert record_ttl_s(REC, NOW, CD) == pytest.approx(40.0)
    assert record_ttl_s(REC, 2000.0, CD) == pytest.approx(0.001)
    assert record_ttl_s(PROBED, NOW, CD) == pytest.approx(70.0)


@pytest.mark.parametrize(
    ("reports", "existing", "quorum", "want"),
    [
        ([], None, 1, None),
        ([rep("a", 1030)], None, 1, A_1030),
        ([rep("a", 1030)], None, 2, None),  # one member is not a quorum of two
        ([rep("a", 1030), rep("a", 1031)], None, 2, None),  # the same member twice: still one
        (
            [rep("a", 1030), rep("b", 1035, "timeout")],
            None,
            2,
            Record("open", NOW, 1035, "timeout", "me"),  # until the latest retry_at
        ),
        ([rep("a", 999), rep("b", 1035)], None, 2, None),  # a's report expired
        ([rep("a", 1030)], Record("open", 990, 1030, None, "x"), 1, None),  # already written
        ([rep("a", 1030)], Record("open", 990, 1020, None, "x"), 1, A_1030),  # reaches past it
        ([rep("a", 1030)], Record("open", 900, 950, None, "x"), 1, A_1030),  # an expired one
    ],
)  # fmt: skip
def test_quorum_record(
    reports: list[Report], existing: Record | None, quorum: int, want: Record | None
) -> None:
    assert quorum_record(reports, existing, NOW, quorum, CD, "me") == want


def test_live_members_keep_each_members_latest_unexpired_report() -> None:
    live = live_members([rep("a", 1010), rep("a", 1020), rep("b", NOW)], NOW)
    assert live == {"a": rep("a", 1020)}


@pytest.mark.parametrize(
    ("state", "busy", "want"),
    [
        (FleetState.NONE, False, Admission.LOCAL),
        (FleetState.NONE, True, Admission.LOCAL),
        (FleetState.OPEN, False, Admission.SKIP),
        (FleetState.HALF_OPEN, False, Admission.LEASE),
        (FleetState.HALF_OPEN, True, Admission.SKIP),  # this member is already probing
    ],
)
def test_admission(state: FleetState, busy: bool, want: Admission) -> None:
    assert admission(state, busy) is want


HALF = Record("open", 960.0, 990.0, "http_503", "x")  # half_open at NOW
REOPENED = Record("open", NOW, NOW + CD, "http_503", "x")


@pytest.mark.parametrize(
    ("taken", "record", "want"),
    [
        (True, HALF, (LeaseOutcome.PROBE, False)),
        (False, HALF, (LeaseOutcome.SKIP, False)),  # another member holds it
        (False, None, (LeaseOutcome.SKIP, False)),
        (True, REOPENED, (LeaseOutcome.SKIP, True)),  # the probe failed meanwhile
        (True, None, (LeaseOutcome.LOCAL, True)),  # closed meanwhile: decide alone
    ],
)
def test_after_lease(taken: bool, record: Record | None, want: tuple[LeaseOutcome, bool]) -> None:
    assert after_lease(taken, record, NOW, CD) == want


@pytest.mark.parametrize(
    ("verdict", "retry_after", "want"),
    [
        (Verdict.SUCCESS, None, Close(NOW, "me")),
        (Verdict.FAILURE, None, Record("open", NOW, NOW + CD, "http_503", "me")),
        (Verdict.FAILURE, 5.0, Record("open", NOW, NOW + CD, "http_503", "me")),
        (Verdict.FAILURE, 90.0, Record("open", NOW, NOW + 90, "http_503", "me")),
        (Verdict.NEUTRAL, None, None),
        (None, None, None),  # cancelled: the lease is given back, nothing written
    ],
)
def test_after_probe(verdict: Verdict | None, retry_after: float | None, want: object) -> None:
    got = after_probe(verdict, NOW, CD, "me", retry_after_s=retry_after, last_failure="http_503")
    assert got == want


@pytest.mark.parametrize(
    ("close", "open_since", "applied", "want"),
    [
        (None, 900.0, None, False),
        (Close(NOW, "x"), None, None, False),  # this member's breaker is closed
        (Close(NOW, "x"), 900.0, None, True),
        (Close(NOW, "x"), 1001.0, None, False),  # it opened after the close: a new outage
        (Close(NOW, "x"), 900.0, NOW, False),  # already applied
        (Close(NOW, "x"), 900.0, 950.0, True),  # a newer close
    ],
)
def test_close_applies(
    close: Close | None, open_since: float | None, applied: float | None, want: bool
) -> None:
    assert close_applies(close, open_since, applied) is want


def test_missing_reports_are_published_again() -> None:
    other = Target("backup", "*")
    gone = Target("old", "*")
    own = {T: rep("me", 1030), other: rep("me", 1030), gone: rep("me", 999)}
    views = {T: TargetView(reports=(rep("me", 1030),)), other: TargetView()}
    assert missing_reports(own, views, NOW) == [(other, rep("me", 1030))]


def test_store_health_says_each_change_once() -> None:
    h = StoreHealth()
    seen = [h.observe(ok) for ok in (False, False, True, True, False, False, True)]
    assert seen == [
        "fleet_store_unavailable",
        None,
        "fleet_store_available",
        None,
        "fleet_store_unavailable",
        None,
        "fleet_store_available",
    ]


def test_every_key_and_the_channel_start_with_the_prefix_and_hold_config_names_only() -> None:
    k = Keys("team-a:")
    names = [k.record(T), k.reports(T), k.failures(T), k.lease(T), k.close(T), k.channel]
    assert all(n.startswith("team-a:") for n in names)
    assert k.record(T) == "team-a:record:openai:gpt-4o"
    assert len(set(names)) == len(names)


def test_member_name_is_hostname_slash_pid() -> None:
    assert member_name({"HOSTNAME": "llm-app-7d9f-x2"}, 42) == "llm-app-7d9f-x2/42"
    assert member_name({}, 7).endswith("/7")


def test_force_close_closes_an_open_breaker_once() -> None:
    settings = BreakerSettings(
        failure_threshold=1, cooldown_s=10, half_open_max_probes=1, success_threshold=1
    )
    b = Breakers({T: settings})
    assert b.force_close(T, 0.0) is None  # closed already
    permit = b.admit(T, 0.0)
    assert permit is not None
    b.record(permit, Verdict.FAILURE, 0.0, last_failure="http_503")
    moved = b.force_close(T, 1.0)
    assert moved is not None and (moved.from_state, moved.to_state) == (State.OPEN, State.CLOSED)
    st = b.state(T)
    assert st is not None and (st.consecutive_failures, st.retry_at) == (0, None)
    b.record(permit, Verdict.FAILURE, 0.0)  # a stale permit changes nothing
    assert b.state(T) == st


# -- config -----------------------------------------------------------------------------

BASE = """
[upstreams.openai]
base_url = "https://api.openai.com"
[[routes]]
name = "chat"
candidates = [{ upstream = "openai" }]
"""


def test_fleet_defaults_and_absence() -> None:
    assert parse_config(BASE, {}).fleet is None
    fleet = parse_config(BASE + "[fleet]\n", {}).fleet
    assert fleet is not None
    assert (fleet.redis_url_env, fleet.key_prefix) == ("SIDECAR_REDIS_URL", "sidecar:")
    assert (fleet.sync_interval_ms, fleet.open_quorum) == (1000, 1)


def test_fleet_from_the_environment() -> None:
    env = {"SIDECAR__FLEET__OPEN_QUORUM": "3", "SIDECAR__FLEET__KEY_PREFIX": "7"}
    fleet = parse_config(BASE, env).fleet
    assert fleet is not None and (fleet.open_quorum, fleet.key_prefix) == (3, "7")


def test_fleet_validation_names_every_key_and_never_echoes_a_url() -> None:
    text = BASE + (
        '[fleet]\nredis_url_env = "redis://:hunter2@redis:6379"\nkey_prefix = "a b"\n'
        "sync_interval_ms = 0\nopen_quorum = 0\nbogus = 1\n"
    )
    with pytest.raises(ConfigError) as exc:
        parse_config(text, {})
    errors = exc.value.errors
    assert {e.split(":", 1)[0] for e in errors} == {
        "fleet.redis_url_env",
        "fleet.key_prefix",
        "fleet.sync_interval_ms",
        "fleet.open_quorum",
        "fleet.bogus",
    }
    assert "hunter2" not in "\n".join(errors)
    assert "fleet.sync_interval_ms: must be > 0" in errors


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (None, "variable SIDECAR_REDIS_URL is not set"),
        ("", "variable SIDECAR_REDIS_URL is not set"),
        ("http://:hunter2@redis:6379", "must hold a redis://host:port URL"),
        ("redis://:hunter2@redis:99999", "does not hold a valid URL"),
        ("redis://:hunter2@redis:6379/0", None),
        ("rediss://user:hunter2@redis.example:6380", None),
    ],
)
def test_the_redis_url_variable(value: str | None, problem: str | None) -> None:
    config = parse_config(BASE + "[fleet]\n", {})
    env = {} if value is None else {"SIDECAR_REDIS_URL": value}
    found = fleet_env_problems(config, env)
    if problem is None:
        assert found == []
    else:
        assert found == [f"fleet.redis_url_env: {problem}"] or problem in found[0]
        assert "hunter2" not in found[0]
    assert fleet_env_problems(parse_config(BASE, {}), {}) == []

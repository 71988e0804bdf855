"""The fleet's rules, pure: what a member publishes, when the fleet says open, the lease.

Contract: ``interface.md``, "The fleet: breakers shared through Redis (opt-in)".
Counts stay local; decisions are shared:

* a member whose own breaker opens a target publishes a :class:`Report` (member,
  ``retry_at``, ``last_failure``) that expires at that ``retry_at``;
* when ``open_quorum`` distinct members hold unexpired reports, the fleet
  :class:`Record` is written: open until the latest reported ``retry_at``
  (:func:`quorum_record`);
* by time, a record is ``open`` until its ``retry_at``, then ``half_open`` for one
  cooldown, then gone (:func:`record_state`): one probe for the whole fleet, sent
  only by the member that took the probe lease (:func:`admission`,
  :func:`after_lease`);
* the probe's verdict: a success publishes a :class:`Close` (every member closes
  its own breaker, :func:`close_applies`), a failure writes the record open again
  for another cooldown, with no quorum (:func:`after_probe`).

Pure: no asyncio, no Redis, no clock reads. Times are **Unix seconds** (float),
since they cross processes: the caller passes ``now`` from its clock's ``wall``.
Only config target names, member names, states, times and ``last_failure`` are
ever part of these values (never a key, URL, header or body).
"""

from __future__ import annotations

import enum
import os
import socket
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import msgspec

from sidecar.breakers.machine import Target, Verdict

if TYPE_CHECKING:
    from sidecar.config import Config

LEASE_WAIT_S = 0.25
"""Longest a request waits to take the probe lease; then the member decides alone."""
LEASE_SLACK_S = 1.0
"""The lease expires after the upstream's ``first_byte_timeout_ms`` plus this."""
CLOSE_KEPT_SYNCS = 10
"""A close is kept for this many ``sync_interval_ms``."""


class FleetState(enum.Enum):
    """What the fleet record says about a target right now."""

    NONE = "none"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The fleet record of one target, as stored (JSON). Times: Unix seconds.

    Stored as ``open``; it reads as half_open from ``retry_at`` on (:func:`record_state`).
    """

    state: str
    opened_at: float
    retry_at: float
    last_failure: str | None
    by: str
    """The member that wrote it."""
    probe_until: float | None = None
    """Set by the member that took the lease: half_open at least until then (its lease
    expires then), so a probe slower than a cooldown keeps the others skipping."""


class Close(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A published close: a probe succeeded at ``at`` (Unix seconds), sent by ``by``."""

    at: float
    by: str


class Report(msgspec.Struct, frozen=True):
    """One member's own breaker opened a target; valid until ``retry_at`` (Unix seconds)."""

    member: str
    retry_at: float
    last_failure: str | None


class OverrideRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An operator's override of one target, as stored (JSON) for every member to follow
    (contract, "The admin port": "with the fleet on, shared with every member").

    ``action``: ``force_open``, ``force_closed``, or ``auto`` (kept a short while, as a
    close is, so that every member ends what it follows and resets the breaker);
    ``until``: its end (Unix seconds), None for none; ``at`` and ``by``: when and on which
    member's admin port it was taken (together they name it: a member applies each
    record once).
    """

    action: str
    reason: str
    until: float | None
    for_ms: int | None
    at: float
    by: str


class TargetView(msgspec.Struct, frozen=True):
    """One target as read from the store in one sync."""

    record: Record | None = None
    close: Close | None = None
    reports: tuple[Report, ...] = ()
    override: OverrideRecord | None = None


class Admission(enum.Enum):
    """For a call its own breaker admitted: LOCAL (no fleet decision applies: the
    member's own breaker decides), SKIP (as if its own breaker were open), LEASE
    (a half-open fleet record: take the probe lease first)."""

    LOCAL = "local"
    SKIP = "skip"
    LEASE = "lease"


class LeaseOutcome(enum.Enum):
    """After trying to take the lease: PROBE (ours, and the record is half_open: send
    the fleet's probe), SKIP (another member holds it, or the record is open again),
    LOCAL (no half-open record any more, or no answer in time: decide alone)."""

    PROBE = "probe"
    SKIP = "skip"
    LOCAL = "local"


def member_name(environ: Mapping[str, str], pid: int | None = None) -> str:
    """``<HOSTNAME>/<pid>`` (the pod name in Kubernetes; the host name elsewhere)."""
    host = environ.get("HOSTNAME") or socket.gethostname()
    return f"{host}/{os.getpid() if pid is None else pid}"


# -- the rules ----------------------------------------------------------------------------


def _ends(record: Record, cooldown_s: float) -> float:
    return max(record.retry_at + cooldown_s, record.probe_until or 0.0)


def record_state(record: Record | None, now: float, cooldown_s: float) -> FleetState:
    """open before ``retry_at``; half_open for one cooldown after (or until ``probe_until``
    while a probe holds the lease); then none (expired: nobody probed)."""
    if record is None or now >= _ends(record, cooldown_s):
        return FleetState.NONE
    return FleetState.OPEN if now < record.retry_at else FleetState.HALF_OPEN


def record_ttl_s(record: Record, now: float, cooldown_s: float) -> float:
    """Seconds the record must live from ``now``: until it expires by :func:`record_state`."""
    return max(0.001, _ends(record, cooldown_s) - now)


def live_members(reports: Iterable[Report], now: float) -> dict[str, Report]:
    """The distinct members with an unexpired report, each with its latest report."""
    out: dict[str, Report] = {}
    for r in reports:
        if r.retry_at > now and (r.member not in out or r.retry_at > out[r.member].retry_at):
            out[r.member] = r
    return out


def quorum_record(
    reports: Iterable[Report],
    existing: Record | None,
    now: float,
    quorum: int,
    cooldown_s: float,
    member: str,
) -> Record | None:
    """The record to write, or None: ``quorum`` distinct members hold unexpired reports,
    and there is no record yet (or an expired one), or the reports reach past it.

    The record is open until the latest reported ``retry_at``, with that report's
    ``last_failure``.
    """
    live = live_members(reports, now)
    if len(live) < quorum:
        return None
    latest = max(live.values(), key=lambda r: r.retry_at)
    if record_state(existing, now, cooldown_s) is not FleetState.NONE:
        assert existing is not None
        if existing.retry_at >= latest.retry_at:
            return None
    return Record("open", now, latest.retry_at, latest.last_failure, member)


def admission(state: FleetState, busy_here: bool) -> Admission:
    """For a call the member's own breaker admitted: follow the fleet, or decide alone.

    ``busy_here``: this member is already taking, or holds, the target's lease.
    """
    if state is FleetState.OPEN:
        return Admission.SKIP
    if state is FleetState.HALF_OPEN:
        return Admission.SKIP if busy_here else Admission.LEASE
    return Admission.LOCAL


def after_lease(
    taken: bool, record: Record | None, now: float, cooldown_s: float
) -> tuple[LeaseOutcome, bool]:
    """(what to do, whether to give the lease back) after one set-if-absent attempt.

    ``record`` is the record as read in the same atomic step. Taken while the record
    is half_open: probe. Not taken: someone else probes, skip. Taken but the record is
    open again: skip; gone: decide alone (both give the lease back).
    """
    if not taken:
        return LeaseOutcome.SKIP, False
    state = record_state(record, now, cooldown_s)
    if state is FleetState.HALF_OPEN:
        return LeaseOutcome.PROBE, False
    return (LeaseOutcome.SKIP if state is FleetState.OPEN else LeaseOutcome.LOCAL), True


def after_probe(
    verdict: Verdict | None,
    now: float,
    cooldown_s: float,
    member: str,
    *,
    retry_after_s: float | None = None,
    last_failure: str | None = None,
) -> Close | Record | None:
    """The write a settled fleet probe makes (the lease is given back in every case).

    SUCCESS: a close (record and reports deleted). FAILURE: the record open again for
    another cooldown, or ``retry_after_s`` (already capped) when longer; no quorum.
    NEUTRAL or no verdict (cancelled): nothing; the record stays half_open.
    """
    if verdict is Verdict.SUCCESS:
        return Close(now, member)
    if verdict is Verdict.FAILURE:
        retry_at = now + max(cooldown_s, retry_after_s or 0.0)
        return Record("open", now, retry_at, last_failure, member)
    return None


def close_applies(close: Close | None, open_since: float | None, applied: float | None) -> bool:
    """Whether a close closes this member's own breaker for the target.

    ``open_since``: when this member's own breaker opened (Unix s), None when closed.
    A close applies once (``applied``: the ``at`` of the last one applied), and only
    to a breaker that opened before it (a newer outage is not closed by an old close).
    """
    if close is None or open_since is None:
        return False
    if applied is not None and close.at <= applied:
        return False
    return open_since < close.at


def missing_reports(
    own: Mapping[Target, Report], views: Mapping[Target, TargetView], now: float
) -> list[tuple[Target, Report]]:
    """This member's open breakers whose report the store lacks (the store restarted,
    was down when the breaker opened, or lost it): to publish again."""
    out = []
    for target, report in own.items():
        if report.retry_at <= now:
            continue
        view = views.get(target, TargetView())
        if report.member not in live_members(view.reports, now):
            out.append((target, report))
    return out


class StoreHealth:
    """Up/down of the store, for one log line per change.

    :meth:`observe` returns ``"fleet_store_available"`` on the first success and on
    each return after an outage, ``"fleet_store_unavailable"`` once per outage (the
    first failure, also at start), else None.
    """

    def __init__(self) -> None:
        self.up: bool | None = None

    def observe(self, ok: bool) -> str | None:
        if self.up is ok:
            return None
        self.up = ok
        return "fleet_store_available" if ok else "fleet_store_unavailable"


def fleet_env_problems(config: Config, environ: Mapping[str, str]) -> list[str]:
    """What is wrong with ``[fleet]``'s Redis URL variable, as ``fleet.redis_url_env: ...``
    lines: unset or empty, or not a ``redis://`` / ``rediss://`` / ``unix://`` URL.

    The value is never echoed (it holds the Redis password). ``[]`` without ``[fleet]``.
    """
    fleet = config.fleet
    if fleet is None:
        return []
    var = fleet.redis_url_env
    value = environ.get(var)
    if not value:
        return [f"fleet.redis_url_env: variable {var} is not set"]
    try:
        u = urlsplit(value)
        _ = u.port
    except ValueError:
        return [f"fleet.redis_url_env: variable {var} does not hold a valid URL"]
    if u.scheme not in ("redis", "rediss", "unix") or (u.scheme != "unix" and not u.hostname):
        return [f"fleet.redis_url_env: variable {var} must hold a redis://host:port URL"]
    return []

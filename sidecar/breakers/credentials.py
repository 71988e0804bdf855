"""The breakers of (target, credential): one caller's rate limit stays theirs (pure).

Contract, "Bounding the load that failures add": with ``rate_limit_scope =
"credential"`` a rate-limit failure (a 429, a ``rate_limit_error`` /
``rate_limit_exceeded`` error event) counts against the breaker of (target,
credential), the credential being the request's value of the upstream's
``auth_header``; every other failure counts against the target's own breaker
(:class:`~sidecar.breakers.machine.Breakers`). Providers rate-limit per key, so a
429 says "this key is over its limit", not "the provider is down".

Each (target, credential) breaker follows the target's breaker rules
(:func:`~sidecar.breakers.machine.next_state`, the target's
:class:`~sidecar.breakers.types.BreakerSettings`) on the consecutive count only: no
failure-rate window and no paced recovery (``failure_rate_threshold`` and ``ramp_ms``
are the target's). What each verdict means here:

- a rate-limit FAILURE counts (and opens it at ``failure_threshold``, for the cooldown
  or the answer's longer ``Retry-After``);
- a SUCCESS resets the count (closed) or counts towards ``success_threshold``
  (half_open);
- anything else (another failure, a neutral call) is neutral here: it frees a probe's
  slot and changes nothing else.

Bounded and forgetful, so that a breaker is kept only while it says something:

- a breaker that is closed with no failure counted is not kept (a new one is the same);
- a closed breaker is forgotten ``window_s`` (the target's ``window_ms``, 60 s by
  default) after its credential's last rate-limit failure; an open or half-open one
  ``window_s`` after its ``retry_at`` when no probe is in flight (its credential did not
  come back);
- at most :data:`LIMIT` per target: past it the closed ones are forgotten first, least
  recently failed first, then the open ones, least recently moved first.

:attr:`CredentialBreakers.held` counts the breakers kept (all targets): while it is 0
the request path does not hash a credential at all (the hot path's one check).

Credentials are held only as keyed hashes (:func:`credential_key`: BLAKE2b with a
random key per process, as :mod:`sidecar.affinity` keeps sessions); ``/status`` shows
the first 8 hex digits (:func:`short`). The open -> half_open move is made when the
credential's next request asks (or ``/status`` reads it, :meth:`CredentialBreakers.tick`),
not on a timer: there may be thousands.

Pure: no clock reads, no asyncio; ``now`` is monotonic seconds handed in.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from msgspec.structs import replace

from sidecar.breakers.machine import INITIAL, next_state, to_half_open
from sidecar.breakers.types import (
    BreakerSettings,
    BreakerState,
    CredentialPermit,
    State,
    Target,
    Verdict,
)

__all__ = [
    "LIMIT",
    "OTHER_CREDENTIAL_HEADERS",
    "CredentialBreakers",
    "CredentialMove",
    "credential_key",
    "credential_of",
    "short",
]

LIMIT = 10_000
"""Breakers of (target, credential) kept at most per target (the contract's bound)."""

_SECRET = os.urandom(32)
"""The process's key for :func:`credential_key`: a credential cannot be recovered from
the table, nor its hash matched against one made by another process."""


def credential_key(value: str) -> bytes:
    """The table's key of a credential: a keyed BLAKE2b hash (16 bytes) of ``value``
    (:func:`credential_of`); the value itself is never kept."""
    data = value.encode("utf-8", "surrogateescape")
    return hashlib.blake2b(data, key=_SECRET, digest_size=16).digest()


OTHER_CREDENTIAL_HEADERS = ("authorization", "x-api-key", "api-key")
"""Where a request's credential is looked for when the upstream's ``auth_header`` is
absent, in this order (:data:`sidecar.headers.CREDENTIAL_HEADERS`)."""


def credential_of(headers: Mapping[str, str], header: str) -> str:
    """The credential of a request: the value of ``header`` (the upstream's
    ``auth_header``), else of the first of :data:`OTHER_CREDENTIAL_HEADERS` it has, else
    ``""``; a leading ``Bearer`` (any case) is dropped, so one key is one credential in
    ``Authorization: Bearer k`` and in ``x-api-key: k``.

    Why the other headers: a client may send its key in another header than the one
    configured (the Anthropic SDK 2.x sends ``Authorization: Bearer``, where its API
    documents ``x-api-key``); telling callers apart by the header they did send keeps
    one caller's rate limit theirs instead of lumping every such caller into ``""``.
    """
    value = headers.get(header)
    if value is None:
        for name in OTHER_CREDENTIAL_HEADERS:
            value = headers.get(name)
            if value is not None:
                break
        else:
            return ""
    if value[:7].lower() == "bearer ":
        return value[7:].strip()
    return value


def short(key: bytes) -> str:
    """What ``/status`` and the logs show of a credential: its hash's first 8 hex digits."""
    return key[:4].hex()


class CredentialMove(NamedTuple):
    """A state move of a (target, credential) breaker, for the logs; ``state`` is the new
    state after the move."""

    target: Target
    key: bytes
    from_state: State
    to_state: State
    state: BreakerState


class _Table:
    """One target's credential breakers."""

    __slots__ = ("counting", "header", "settings", "tripped")

    def __init__(self, settings: BreakerSettings, header: str) -> None:
        self.settings = settings
        self.header = header
        self.counting: OrderedDict[bytes, tuple[BreakerState, float]] = OrderedDict()
        """Closed breakers with failures counted, and when the last one came; least
        recently failed first."""
        self.tripped: OrderedDict[bytes, BreakerState] = OrderedDict()
        """Open and half-open breakers, least recently moved first."""

    def __len__(self) -> int:
        return len(self.counting) + len(self.tripped)


class CredentialBreakers:
    """The (target, credential) breakers of every target whose upstream has a breaker and
    ``rate_limit_scope = "credential"``.

    :param settings: the targets' breaker settings (targets absent have no breaker).
    :param headers: per target with the credential scope, its upstream's ``auth_header``
        (lower-case); a target absent here (scope ``target``) gets no credential breakers.
    :param limit: breakers kept at most per target (:data:`LIMIT`).
    """

    __slots__ = ("_tables", "held", "limit")

    def __init__(
        self,
        settings: Mapping[Target, BreakerSettings],
        headers: Mapping[Target, str],
        limit: int = LIMIT,
    ) -> None:
        self.limit = limit
        self._tables = {
            t: _Table(replace(cfg, failure_rate=0.0, ramp_s=0.0), headers[t])
            for t, cfg in settings.items()
            if t in headers
        }
        self.held = 0
        """Breakers kept, all targets together: 0 means no credential needs hashing."""

    def carry(self, old: CredentialBreakers, targets: Iterable[Target]) -> None:
        """Keep ``old``'s breakers of ``targets`` (a reload kept those targets' breakers:
        same settings) whose credential header is the same; copied as they are."""
        for target in targets:
            mine, theirs = self._tables.get(target), old._tables.get(target)
            if mine is None or theirs is None or mine.header != theirs.header:
                continue
            self.held -= len(mine)
            mine.counting = OrderedDict(theirs.counting)
            mine.tripped = OrderedDict(theirs.tripped)
            self.held += len(mine)

    def header(self, target: Target) -> str | None:
        """The header that holds ``target``'s credential, or None when rate limits count
        against the target itself (scope ``target``, or no breaker)."""
        table = self._tables.get(target)
        return None if table is None else table.header

    def holds(self, target: Target) -> bool:
        """Whether any breaker of ``target``'s credentials is kept (else none is asked)."""
        table = self._tables.get(target)
        return table is not None and len(table) > 0

    def admit(
        self, target: Target, key: bytes, now: float
    ) -> tuple[CredentialPermit | None, list[CredentialMove]]:
        """Whether credential ``key`` may call ``target`` now: a permit (a probe when its
        breaker is half-open), or None to skip the target for this request (open, or
        half-open with every slot taken); and the open -> half_open move made now, if
        its cooldown ended."""
        table = self._tables.get(target)
        if table is None:
            return CredentialPermit(key, 0, False), []
        self._forget(table, now)
        s = table.tripped.get(key)
        if s is None:
            entry = table.counting.get(key)
            return CredentialPermit(key, 0 if entry is None else entry[0].generation, False), []
        moves: list[CredentialMove] = []
        if s.state is State.OPEN and s.retry_at is not None and now >= s.retry_at:
            new = to_half_open(s)
            moves.append(self._store(target, table, key, s, new, now))
            s = new
        if s.state is State.HALF_OPEN and s.probes_in_flight < table.settings.half_open_max_probes:
            table.tripped[key] = replace(s, probes_in_flight=s.probes_in_flight + 1)
            return CredentialPermit(key, s.generation, True), moves
        return None, moves

    def record(
        self,
        target: Target,
        permit: CredentialPermit,
        verdict: Verdict,
        now: float,
        *,
        rate_limit: bool,
        last_failure: str | None = None,
        retry_after_s: float | None = None,
    ) -> list[CredentialMove]:
        """Settle a call made with ``permit`` (once, after its retries).

        :param verdict: the call's verdict; only a FAILURE with ``rate_limit`` counts as
            a failure here, any other FAILURE is neutral here.
        :param retry_after_s: the failing answer's capped ``Retry-After``: opens for
            longer than the cooldown, or extends an open breaker (never shortens it).
        :returns: the move made, if any. A permit issued in an older state changes
            nothing (but a ``Retry-After``); a rate-limit failure of a credential with no
            breaker makes one (closed, counting), whatever generation its permit had.
        """
        table = self._tables.get(target)
        if table is None:
            return []
        self._forget(table, now)
        key = permit.key
        if verdict is Verdict.FAILURE and not rate_limit:
            verdict = Verdict.NEUTRAL
        s = table.tripped.get(key)
        if s is None:
            entry = table.counting.get(key)
            if entry is None:
                if verdict is not Verdict.FAILURE or permit.probe:
                    return []
                s, current = INITIAL, True
            else:
                s = entry[0]
                current = not permit.probe and permit.generation == s.generation
        elif s.state is State.OPEN:
            if verdict is Verdict.FAILURE and retry_after_s is not None:
                self._extend(table, key, s, now + retry_after_s)
            return []
        else:
            current = permit.probe and permit.generation == s.generation
        if not current:
            return []
        new = next_state(s, verdict, table.settings, now, last_failure, retry_after_s)
        if new is s:
            return []
        moved = self._store(target, table, key, s, new, now, failed=verdict is Verdict.FAILURE)
        return [] if moved.from_state is moved.to_state else [moved]

    def release(self, target: Target, permit: CredentialPermit) -> None:
        """Settle ``permit`` with no verdict (cancellation): frees a current probe's slot."""
        table = self._tables.get(target)
        if table is None or not permit.probe:
            return
        s = table.tripped.get(permit.key)
        if s is not None and s.state is State.HALF_OPEN and s.generation == permit.generation:
            table.tripped[permit.key] = replace(s, probes_in_flight=max(0, s.probes_in_flight - 1))

    def retry_in(self, target: Target, key: bytes, now: float) -> float | None:
        """Seconds until credential ``key``'s breaker lets it call ``target`` again:
        0.0 when it does now (closed, none, or a free probe slot), None when unknown
        (half-open, every slot taken)."""
        table = self._tables.get(target)
        s = None if table is None else table.tripped.get(key)
        if s is None or table is None:
            return 0.0
        if s.state is State.OPEN and s.retry_at is not None:
            return max(0.0, s.retry_at - now)
        if s.probes_in_flight < table.settings.half_open_max_probes:
            return 0.0
        return None

    def state(self, target: Target, key: bytes) -> BreakerState | None:
        """The stored state of credential ``key``'s breaker on ``target`` (None: none)."""
        table = self._tables.get(target)
        if table is None:
            return None
        s = table.tripped.get(key)
        if s is not None:
            return s
        entry = table.counting.get(key)
        return None if entry is None else entry[0]

    def tick(self, now: float) -> list[CredentialMove]:
        """Move every open breaker whose ``retry_at <= now`` to half_open (and forget the
        stale ones): what ``/status`` does before it lists them. The moves made."""
        moves: list[CredentialMove] = []
        for target, table in self._tables.items():
            self._forget(table, now)
            for key, s in list(table.tripped.items()):
                if s.state is State.OPEN and s.retry_at is not None and now >= s.retry_at:
                    table.tripped[key] = new = to_half_open(s)  # in place: keeps the order
                    moves.append(CredentialMove(target, key, s.state, new.state, new))
        return moves

    def tripped(self) -> list[tuple[Target, bytes, BreakerState]]:
        """Every open and half-open breaker: (target, credential key, state)."""
        return [(t, k, s) for t, table in self._tables.items() for k, s in table.tripped.items()]

    # -- internals -------------------------------------------------------------------

    def _store(
        self,
        target: Target,
        table: _Table,
        key: bytes,
        old: BreakerState,
        new: BreakerState,
        now: float,
        *,
        failed: bool = False,
    ) -> CredentialMove:
        before = len(table)
        if new.state is State.CLOSED:
            table.tripped.pop(key, None)
            if new.consecutive_failures == 0:  # as good as a new one: not kept
                table.counting.pop(key, None)
            else:
                entry = table.counting.get(key)
                since = now if failed or entry is None else entry[1]
                table.counting[key] = (new, since)
                table.counting.move_to_end(key)
        else:
            table.counting.pop(key, None)
            table.tripped[key] = new
            if new.state is not old.state:
                table.tripped.move_to_end(key)
        while len(table) > self.limit:  # the closed ones first, then the open ones
            if table.counting:
                table.counting.popitem(last=False)
            else:
                table.tripped.popitem(last=False)
        self.held += len(table) - before
        return CredentialMove(target, key, old.state, new.state, new)

    def _extend(self, table: _Table, key: bytes, s: BreakerState, retry_at: float) -> None:
        if s.retry_at is not None and retry_at > s.retry_at:
            table.tripped[key] = replace(s, retry_at=retry_at)

    def _forget(self, table: _Table, now: float) -> None:
        """Forget the stale breakers at the old end of each list (amortised O(1))."""
        if not len(table):
            return
        before = len(table)
        horizon = now - table.settings.window_s
        counting = table.counting
        while counting:
            _, (_, since) = next(iter(counting.items()))
            if since > horizon:
                break
            counting.popitem(last=False)
        tripped = table.tripped
        while tripped:
            s = next(iter(tripped.values()))
            if s.probes_in_flight or s.retry_at is None or s.retry_at > horizon:
                break
            tripped.popitem(last=False)
        self.held += len(table) - before

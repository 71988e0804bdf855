"""Sessions that keep to one tier member (pure): the table and its rules.

Contract, "Choosing among candidates" ("Sessions", ``affinity_header``): the first
request of a session (a value of that header) is placed by the route's ``balance``;
later requests with the same value go to the same member while its breaker admits
them, so a provider's prompt cache keeps serving that conversation (providers bill
cached input at a tenth). When the member's breaker opens, the session moves once to
another member and stays there, also after the first member recovers; a failure that
does not open the breaker never moves it. The table is bounded (:data:`LIMIT`, least
recently used first out) and forgets a session unseen for ``affinity_ttl_ms``; the
header's value is kept only as a keyed hash (:func:`session_key`).

Only members of a route's first tier hold sessions: a request served by a later tier
(every first-tier member refused or failed) leaves its session where it was.

Pure: times are monotonic seconds handed in from the injected clock.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Literal

from sidecar.breakers.types import Target

__all__ = ["LIMIT", "Outcome", "Sessions", "session_key"]

LIMIT = 100_000
"""Sessions kept at most (the contract's bound); the least recently used go first."""

_SECRET = os.urandom(32)
"""The process's key for :func:`session_key`: a header value cannot be recovered from
the table, nor guessed from a hash seen elsewhere."""

Outcome = Literal["new", "kept", "moved"]
"""``sidecar_affinity_total``'s ``result``."""


def session_key(route: str, value: str) -> bytes:
    """The table's key for a session: a keyed BLAKE2b hash of the route and the header's
    value (16 bytes; the value itself is never kept)."""
    h = hashlib.blake2b(key=_SECRET, digest_size=16)
    h.update(route.encode())
    h.update(b"\0")
    h.update(value.encode("utf-8", "surrogateescape"))
    return h.digest()


class Sessions:
    """Session -> the tier member it keeps to, bounded and expiring.

    :param limit: the most sessions kept (:data:`LIMIT`).
    """

    __slots__ = ("_table", "limit")

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._table: OrderedDict[bytes, tuple[Target, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def member(self, key: bytes, now: float) -> Target | None:
        """The member the session keeps to, or None (new, or forgotten: unseen too long)."""
        entry = self._table.get(key)
        if entry is None:
            return None
        target, expires_at = entry
        if now >= expires_at:
            del self._table[key]
            return None
        return target

    def settle(
        self,
        key: bytes,
        kept_to: Target | None,
        served: Target,
        first_tier: frozenset[Target],
        kept_refuses: bool,
        ttl_s: float,
        now: float,
    ) -> Outcome | None:
        """After a request of the session was answered by ``served``: where it keeps to now.

        :param kept_to: the member the session kept to when the request came (None: new).
        :param served: the member whose answer was committed to.
        :param first_tier: the route's first-tier members (the only ones that hold sessions).
        :param kept_refuses: whether ``kept_to``'s breaker refuses calls now (open, or
            half-open with every probe slot taken): only then does the session move.
        :param ttl_s: ``affinity_ttl_ms`` in seconds: the session is forgotten when unseen
            this long.
        :returns: ``new`` (placed on ``served``), ``kept`` (on ``kept_to``, whoever
            served this request), ``moved`` (from ``kept_to``, whose breaker opened, to
            ``served``), or None (a new session served by a later tier: not placed).
        """
        table = self._table
        if kept_to is None or (kept_refuses and kept_to != served):
            if served not in first_tier:
                if kept_to is not None:  # keep it while it waits for a first-tier member
                    table[key] = (kept_to, now + ttl_s)
                    table.move_to_end(key)
                return None
            table[key] = (served, now + ttl_s)
            table.move_to_end(key)
            if len(table) > self.limit:
                table.popitem(last=False)
            return "new" if kept_to is None else "moved"
        table[key] = (kept_to, now + ttl_s)
        table.move_to_end(key)
        return "kept"

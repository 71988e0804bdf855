"""The fleet's Redis adapter: a thin layer of commands under :mod:`sidecar.fleet`.

One method per store step, each a pipeline of plain commands (``MULTI`` where
steps must be atomic); the rules live in :mod:`sidecar.fleet`. Nothing here is
on the request path but :meth:`Store.take_lease`, which the caller bounds by
:data:`sidecar.fleet.LEASE_WAIT_S`.

Written values are config target names, member names, states, times and
``last_failure`` only, and an operator's override with its ``reason``. The URL (with
its password) is handed to redis-py and kept nowhere else; errors raised here are
redis-py's or :class:`OSError`, and callers log only their class name.

Layout per target (:class:`Keys`): the record (JSON, ``PX``),
the reports (sorted set member -> ``retry_at``, plus a hash member ->
``last_failure``), the lease (``SET NX PX``, the holder's name), the last close
(JSON, ``PX``) and an operator's override (JSON, ``PX`` at its end, if it has
one); one channel announces changes (the message is the writer's member name, so a
member ignores its own). See :class:`Keys`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from sidecar.breakers.machine import Target
from sidecar.fleet import Close, OverrideRecord, Record, Report, TargetView


class Keys:
    """Every key and the channel, each starting with ``prefix`` (``[fleet].key_prefix``).

    Keys name targets by config names only: ``<prefix>record:<upstream>:<model>``.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.channel = prefix + "changes"

    def _key(self, kind: str, t: Target) -> str:
        return f"{self.prefix}{kind}:{t.upstream}:{t.model}"

    def record(self, t: Target) -> str:
        """The fleet record (JSON :class:`Record`), expiring one cooldown after half_open."""
        return self._key("record", t)

    def reports(self, t: Target) -> str:
        """Sorted set: member -> its report's ``retry_at``."""
        return self._key("reports", t)

    def failures(self, t: Target) -> str:
        """Hash: member -> its report's ``last_failure`` ("" for none)."""
        return self._key("failures", t)

    def lease(self, t: Target) -> str:
        """The probe lease: the holder's member name, set-if-absent with an expiry."""
        return self._key("lease", t)

    def close(self, t: Target) -> str:
        """The last close (JSON :class:`Close`), kept ``CLOSE_KEPT_SYNCS`` sync intervals."""
        return self._key("close", t)

    def override(self, t: Target) -> str:
        """An operator's override (JSON :class:`OverrideRecord`), expiring at its end."""
        return self._key("override", t)


# Compare-and-delete: give the lease back only if this member still holds it.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""

_ms = int


def _decode(raw: Any, cls: type[Record] | type[Close] | type[OverrideRecord]) -> Any:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # not ours, or an older layout: ignored


class Store:
    """The fleet's store on one Redis.

    :param url: ``redis://[user:password@]host:port/db`` (secret: never logged).
    :param keys: the key names.
    :param member: this member's name (lease value, message payload).
    :param timeout_s: socket connect and read timeout, seconds; client retries off
        (the caller's sync loop retries).
    """

    def __init__(self, url: str, keys: Keys, member: str, timeout_s: float) -> None:
        self.keys = keys
        self.member = member
        self._r: aioredis.Redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._release = self._r.register_script(_RELEASE)

    async def aclose(self) -> None:
        """Close every connection."""
        await self._r.aclose()

    async def reset(self) -> None:
        """Drop every pooled connection (after a failure: none may be stale when it returns)."""
        await self._r.connection_pool.disconnect()

    async def read(self, targets: Iterable[Target]) -> dict[Target, TargetView]:
        """Every target's record, close and reports, in one round trip."""
        ts = list(targets)
        k = self.keys
        pipe = self._r.pipeline(transaction=False)
        for t in ts:
            pipe.get(k.record(t))
            pipe.get(k.close(t))
            pipe.zrange(k.reports(t), 0, -1, withscores=True)
            pipe.hgetall(k.failures(t))
            pipe.get(k.override(t))
        res = await pipe.execute()
        out = {}
        for i, t in enumerate(ts):
            record, close, scored, failures, override = res[5 * i : 5 * i + 5]
            reports = tuple(
                Report(str(m), float(score), failures.get(m) or None) for m, score in scored
            )
            out[t] = TargetView(
                _decode(record, Record),
                _decode(close, Close),
                reports,
                _decode(override, OverrideRecord),
            )
        return out

    async def write_override(
        self, t: Target, override: OverrideRecord, ttl_s: float | None, *, reset: bool
    ) -> None:
        """Write an operator's override for ``ttl_s`` seconds (None: until replaced) and
        announce it; with ``reset`` (``force_closed``, ``auto``) the fleet record and the
        reports of ``t`` are deleted too, so the fleet starts from closed."""
        k = self.keys
        pipe = self._r.pipeline(transaction=True)
        px = None if ttl_s is None else max(1, _ms(ttl_s * 1000))
        pipe.set(k.override(t), msgspec.json.encode(override), px=px)
        if reset:
            pipe.delete(k.record(t), k.reports(t), k.failures(t))
        pipe.publish(k.channel, self.member)
        await pipe.execute()

    async def report(self, t: Target, report: Report, keep_s: float, now: float) -> None:
        """Add this member's report (those expired by ``now`` dropped); the set and the
        hash live ``keep_s`` seconds more (the latest writer sets it; a report lost to
        an early expiry is published again by its member's next sync)."""
        k = self.keys
        pipe = self._r.pipeline(transaction=True)
        pipe.zadd(k.reports(t), {report.member: report.retry_at})
        pipe.hset(k.failures(t), report.member, report.last_failure or "")
        pipe.zremrangebyscore(k.reports(t), "-inf", now)
        pipe.pexpire(k.reports(t), max(1, _ms(keep_s * 1000)))
        pipe.pexpire(k.failures(t), max(1, _ms(keep_s * 1000)))
        pipe.publish(k.channel, self.member)
        await pipe.execute()

    async def write_record(self, t: Target, record: Record, ttl_s: float) -> None:
        """Write the fleet record for ``ttl_s`` seconds and announce it."""
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self.keys.record(t), msgspec.json.encode(record), px=_ms(ttl_s * 1000) or 1)
        pipe.publish(self.keys.channel, self.member)
        await pipe.execute()

    async def probe_succeeded(self, t: Target, close: Close, keep_s: float) -> None:
        """Delete the record and the reports, publish the close, give the lease back."""
        k = self.keys
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(k.record(t), k.reports(t), k.failures(t))
        pipe.set(k.close(t), msgspec.json.encode(close), px=_ms(keep_s * 1000) or 1)
        pipe.publish(k.channel, self.member)
        await pipe.execute()
        await self.release_lease(t)

    async def probe_failed(self, t: Target, record: Record, ttl_s: float) -> None:
        """Write the record open again, then give the lease back (in that order, so a
        member that takes the lease next reads the record open)."""
        await self.write_record(t, record, ttl_s)
        await self.release_lease(t)

    async def release_lease(self, t: Target) -> None:
        """Delete the lease if this member holds it."""
        await self._release(keys=[self.keys.lease(t)], args=[self.member])

    async def take_lease(self, t: Target, ttl_s: float) -> tuple[bool, Record | None]:
        """Set-if-absent the lease for ``ttl_s``; with the record read in the same ``MULTI``.

        :returns: (taken, the record at that instant).
        """
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self.keys.lease(t), self.member, nx=True, px=max(1, _ms(ttl_s * 1000)))
        pipe.get(self.keys.record(t))
        taken, record = await pipe.execute()
        return bool(taken), _decode(record, Record)

    async def changes(self) -> AsyncIterator[None]:
        """Yield once per change announced by another member (pub/sub); raises on errors."""
        ps = self._r.pubsub(ignore_subscribe_messages=True)
        try:
            await ps.subscribe(self.keys.channel)
            while True:
                msg = await ps.get_message(timeout=1.0)
                if msg is not None and msg.get("data") != self.member:
                    yield
        finally:
            await ps.aclose()  # type: ignore[no-untyped-call]

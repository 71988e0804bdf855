"""The fleet on the event loop: the background sync, the store's health, the probe lease.

:class:`Fleet` is process-wide (one per ``sidecar serve``), built only when the
config has ``[fleet]``; it outlives config reloads (``[fleet]`` itself changes at
the next restart). Each generation's breakers are a
:class:`~sidecar.fleet.breakers.FleetBreakers`, which reports to it and asks
it; the rules are :mod:`sidecar.fleet`, the Redis commands :mod:`sidecar.fleet.store`.

Nothing on the request path waits for the store but :meth:`Fleet.take_lease`
(bounded by 250 ms). Every other store step runs in one background task: writes
queued by the request path (reports, probe results, lease releases) are sent, then
every target is read, quorum records written, closes applied and missing reports
published again; every ``sync_interval_ms`` (a timer on the injected clock), and
at once after a local change or a change announced by another member.

A failing store (down, slow, refusing, wrong password) fails no request: the
fleet's view is dropped and each member goes on with its own breakers; one
``fleet_store_unavailable`` line per outage, ``fleet_store_available`` when it
answers again, ``sidecar_fleet_store_up`` 0/1, ``sidecar_fleet_syncs_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import msgspec

from sidecar import logs, metrics
from sidecar.breaker import BreakerSettings, BreakerState, Target
from sidecar.clock import Clock, TimerHandle
from sidecar.config import Config, FleetConfig
from sidecar.fleet import (
    CLOSE_KEPT_SYNCS,
    LEASE_WAIT_S,
    Close,
    FleetState,
    LeaseOutcome,
    Record,
    Report,
    StoreHealth,
    TargetView,
    after_lease,
    member_name,
    record_state,
    record_ttl_s,
)
from sidecar.fleet.store import Keys

if TYPE_CHECKING:
    from sidecar.fleet.breakers import FleetBreakers, TargetInfo
    from sidecar.fleet.store import Store

Write = Callable[["Store"], Awaitable[None]]


class Fleet:
    """One member of the fleet.

    :param cfg: the ``[fleet]`` table.
    :param url: the Redis URL (a secret: kept for the client only).
    :param member: this member's name (``<HOSTNAME>/<pid>``).
    :param clock: the injected clock; store times are ``clock.wall(clock.now())``.
    """

    def __init__(self, cfg: FleetConfig, url: str, member: str, clock: Clock) -> None:
        self.cfg = cfg
        self.member = member
        self.clock = clock
        self.keys = Keys(cfg.key_prefix)
        self._url = url
        self.timeout_s = min(1.0, max(LEASE_WAIT_S, cfg.sync_interval_s))
        """Bound on one store step (connect, read), seconds."""
        self.health = StoreHealth()
        self.targets: dict[Target, TargetInfo] = {}
        self.breakers: FleetBreakers | None = None
        self.views: dict[Target, TargetView] = {}
        self._overrides: dict[Target, tuple[int, TargetView]] = {}
        self._pending: list[tuple[int, Target | None, Write]] = []
        self._seq = 0
        self._leasing: set[Target] = set()
        self._applied: dict[Target, float] = {}
        self.store: Store | None = None
        self._wake = asyncio.Event()
        self._listen_ok = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._timer: TimerHandle | None = None
        self.syncs = 0
        """Completed sync rounds (either result); tests wait on it with :meth:`wait_syncs`."""
        self.syncs_started = 0
        """Sync rounds begun; ``syncs_started - syncs`` is 1 while a round is in flight (a
        round in flight may have read the store before a write another member just made)."""
        self._synced = asyncio.Event()

    @classmethod
    def from_config(cls, config: Config, environ: Mapping[str, str], clock: Clock) -> Fleet:
        """The fleet of ``config.fleet``, the URL read from ``environ``.

        :raises ValueError: the URL variable is unset (the CLI checks it first).
        """
        assert config.fleet is not None
        url = environ.get(config.fleet.redis_url_env)
        if not url:
            raise ValueError(
                f"fleet.redis_url_env: variable {config.fleet.redis_url_env} is not set"
            )
        return cls(config.fleet, url, member_name(environ), clock)

    def live_breakers(
        self,
        config: Config,
        settings: Mapping[Target, BreakerSettings],
        clock: Clock,
        keep: Mapping[Target, BreakerState] | None,
    ) -> FleetBreakers:
        """The breakers of a new generation, reporting to this fleet (the newest one wins)."""
        from sidecar.fleet.breakers import FleetBreakers, target_info

        if config.fleet != self.cfg:
            logs.event("config_fleet_changed_needs_restart", level=logging.WARNING)
        self.targets = target_info(config, settings)
        return FleetBreakers(settings, clock, keep, fleet=self)

    # -- views, for the request path (no awaits) ------------------------------------

    @property
    def up(self) -> bool:
        return self.health.up is True

    def now(self) -> float:
        """Unix seconds, from the injected clock."""
        return self.clock.wall(self.clock.now())

    def view(self, t: Target) -> TargetView | None:
        """What this member knows of ``t`` (None when the store is not answering)."""
        if not self.up:
            return None
        over = self._overrides.get(t)
        return over[1] if over is not None else self.views.get(t)

    def record(self, t: Target) -> Record | None:
        view = self.view(t)
        return None if view is None else view.record

    def state(self, t: Target) -> FleetState:
        """The fleet record's state for ``t`` now; NONE when the store is not answering."""
        info = self.targets.get(t)
        if info is None:
            return FleetState.NONE
        return record_state(self.record(t), self.now(), info.cooldown_s)

    def busy(self, t: Target) -> bool:
        """This member is taking ``t``'s lease or holds it for a probe in flight."""
        return t in self._leasing or (self.breakers is not None and self.breakers.probing(t))

    # -- the request path's one wait ----------------------------------------------------

    async def take_lease(self, t: Target) -> LeaseOutcome:
        """Try to take ``t``'s probe lease, waiting at most 250 ms; LOCAL when no answer."""
        store, info = self.store, self.targets.get(t)
        if store is None or info is None or not self.up:
            return LeaseOutcome.LOCAL
        self._leasing.add(t)
        try:
            async with asyncio.timeout(LEASE_WAIT_S):
                taken, record = await store.take_lease(t, info.lease_s)
        except Exception as exc:  # any store failure: decide alone
            self.failed(exc, sync=False)
            return LeaseOutcome.LOCAL
        finally:
            self._leasing.discard(t)
        now = self.now()
        outcome, give_back = after_lease(taken, record, now, info.cooldown_s)
        if give_back:
            self.override(t, record=record)
            self.queue(t, lambda s: s.release_lease(t))
        elif outcome is LeaseOutcome.PROBE and record is not None:
            # Half-open for as long as the lease: a slow probe keeps the others skipping.
            probing = msgspec.structs.replace(record, probe_until=now + info.lease_s)
            self.override(t, record=probing)
            ttl = record_ttl_s(probing, now, info.cooldown_s)
            self.queue(t, lambda s: s.write_record(t, probing, ttl))
        return outcome

    # -- what the breakers report (no awaits) ---------------------------------------------

    def queue(self, t: Target | None, write: Write) -> None:
        """Send ``write`` in the background, before the next read; wakes the sync."""
        self._seq += 1
        self._pending.append((self._seq, t, write))
        self._wake.set()

    def override(self, t: Target, *, record: Record | None, close: Close | None = None) -> None:
        """Set what this member knows of ``t`` now, ahead of the store (kept until a sync
        that sent this member's latest write for ``t`` has read the store)."""
        view = self.views.get(t, TargetView())
        new = TargetView(record, close or view.close, view.reports)
        self._overrides[t] = (self._seq + 1, new)

    def publish_report(self, t: Target, report: Report) -> None:
        """This member's own breaker opened ``t``: publish its report."""
        info = self.targets.get(t)
        if info is None:
            return
        self.queue(t, lambda s: self.send_report(s, t, report))

    async def send_report(self, store: Store, t: Target, report: Report) -> None:
        now = self.now()
        keep = report.retry_at + self.targets[t].cooldown_s - now
        await store.report(t, report, keep, now)

    def publish_close(self, t: Target, close: Close) -> None:
        """A probe of this member succeeded: close ``t`` everywhere."""
        self._applied[t] = close.at
        self.override(t, record=None, close=close)
        keep = CLOSE_KEPT_SYNCS * self.cfg.sync_interval_s
        self.queue(t, lambda s: s.probe_succeeded(t, close, keep))

    def publish_reopen(self, t: Target, record: Record) -> None:
        """The fleet's probe failed: the record open again (no quorum needed)."""
        info = self.targets.get(t)
        if info is None:
            return
        self.override(t, record=record)
        ttl = record_ttl_s(record, self.now(), info.cooldown_s)
        self.queue(t, lambda s: s.probe_failed(t, record, ttl))

    def release_lease(self, t: Target) -> None:
        self.queue(t, lambda s: s.release_lease(t))

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background sync and listener (returns at once; never waits for Redis)."""
        from sidecar.fleet import sync as fleet_sync
        from sidecar.fleet.store import Store

        # redis-py's own debug lines are no JSON events and may describe connections.
        logging.getLogger("redis").setLevel(logging.WARNING)
        metrics.register_fleet()
        metrics.FLEET_STORE_UP.set(0)
        self.store = Store(self._url, self.keys, self.member, self.timeout_s)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(fleet_sync.run(self)),
            loop.create_task(fleet_sync.listen(self)),
        ]
        self._wake.set()

    async def stop(self) -> None:
        """Stop the tasks and close the store's connections (bounded)."""
        store, self.store = self.store, None
        if store is None:
            return
        metrics.unregister_fleet()
        if self._timer is not None:
            self._timer.cancel()
        for task in self._tasks:
            task.cancel()
        # Waited for, not awaited: a task whose cancellation redis-py lost (sync.run)
        # ends at its next step, and a stop must not wait for that (nor swallow its own
        # cancellation, as ``suppress(CancelledError)`` around ``await task`` did).
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.timeout_s)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):
                await store.aclose()

    async def wait_syncs(self, n: int) -> None:
        """Return once :attr:`syncs` ``>= n`` (no timeout: the caller bounds it)."""
        while self.syncs < n:
            self._synced.clear()
            await self._synced.wait()

    # -- the background -------------------------------------------------------------------------

    def failed(self, exc: BaseException, *, sync: bool = True) -> None:
        if sync:
            metrics.FLEET_SYNCS.labels("error").inc()
        self.views = {}
        self._overrides.clear()
        self._listen_ok.clear()
        if (event := self.health.observe(False)) is not None:
            metrics.FLEET_STORE_UP.set(0)
            # The class name only: redis-py's messages may name the host.
            logs.event(event, level=logging.WARNING, member=self.member, error=type(exc).__name__)

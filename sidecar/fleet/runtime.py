"""The fleet on the event loop: one member, its background sync, started and stopped.

:class:`Fleet` is process-wide (one per ``sidecar serve``), built only when the
config has ``[fleet]``; it outlives config reloads (``[fleet]`` itself changes at
the next restart). It puts together what the package splits by ownership:

* :class:`~sidecar.fleet.member.Member` (``member``): what this member knows of the
  store and has yet to tell it, its probe lease and probes; shared by the request
  path and the sync;
* :class:`~sidecar.fleet.sync.SyncLoop` (``sync_loop``): when the store is talked to;
* :class:`~sidecar.fleet.store.Store`: the Redis commands, created at :meth:`Fleet.start`;
* each generation's breakers are a :class:`~sidecar.fleet.breakers.FleetBreakers`
  (built by :class:`sidecar.generation.Generation`) that asks ``member``.

Nothing on the request path waits for the store but
:meth:`~sidecar.fleet.member.Member.take_lease` (bounded by 250 ms). Every other
store step runs in the background: writes queued by the request path are sent, then
every target is read, quorum records written, closes applied and missing reports
published again; every ``sync_interval_ms``, and at once after a local change or a
change announced by another member.

A failing store (down, slow, refusing, wrong password) fails no request: the
fleet's view is dropped and each member goes on with its own breakers; one
``fleet_store_unavailable`` line per outage, ``fleet_store_available`` when it
answers again, ``sidecar_fleet_store_up`` 0/1, ``sidecar_fleet_syncs_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Mapping

from sidecar import logs, metrics
from sidecar.breakers.live import LiveBreakers
from sidecar.breakers.machine import BreakerSettings, Target
from sidecar.clock import Clock
from sidecar.config import Config, FleetConfig
from sidecar.fleet import LEASE_SLACK_S, member_name
from sidecar.fleet.member import Member, TargetInfo
from sidecar.fleet.store import Keys, Store
from sidecar.fleet.sync import SyncLoop


class Fleet:
    """This process in the fleet: its :class:`Member` and :class:`SyncLoop`.

    :param cfg: the ``[fleet]`` table.
    :param url: the Redis URL (a secret: kept for the client only).
    :param member: this member's name (``<HOSTNAME>/<pid>``).
    :param clock: the injected clock; store times are ``clock.wall(clock.now())``.
    """

    def __init__(self, cfg: FleetConfig, url: str, member: str, clock: Clock) -> None:
        self.cfg = cfg
        self.member = Member(cfg, member, clock)
        self.sync_loop = SyncLoop(self.member)
        self._keys = Keys(cfg.key_prefix)
        self._url = url

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

    def adopt(
        self,
        config: Config,
        settings: Mapping[Target, BreakerSettings],
        local: LiveBreakers,
        keep: Collection[Target],
    ) -> Member:
        """Make a new generation's own breakers ``local`` (for the targets in ``settings``,
        of ``config``) the member's: the newest generation wins. ``keep``: the targets
        whose breakers a reload carried over. Returns the member, for its breakers."""
        if config.fleet != self.cfg:
            logs.event("config_fleet_changed_needs_restart", level=logging.WARNING)
        self.member.adopt(target_info(config, settings), local, keep)
        return self.member

    def start(self) -> None:
        """Start the background sync and listener (returns at once; never waits for Redis)."""
        # redis-py's own debug lines are no JSON events and may describe connections.
        logging.getLogger("redis").setLevel(logging.WARNING)
        metrics.register_fleet()
        metrics.FLEET_STORE_UP.set(0)
        member = self.member
        member.store = Store(self._url, self._keys, member.name, member.timeout_s)
        self.sync_loop.start()

    async def stop(self) -> None:
        """Stop the tasks and close the store's connections (bounded)."""
        member = self.member
        store, member.store = member.store, None
        if store is None:
            return
        metrics.unregister_fleet()
        await self.sync_loop.stop(member.timeout_s)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(member.timeout_s):
                await store.aclose()


def target_info(
    config: Config, settings: Mapping[Target, BreakerSettings]
) -> dict[Target, TargetInfo]:
    """Per target with a breaker: its cooldown, and ``first_byte_timeout_ms`` + 1 s (lease)."""
    return {
        t: TargetInfo(
            s.cooldown_s, config.upstreams[t.upstream].first_byte_timeout_s + LEASE_SLACK_S
        )
        for t, s in settings.items()
    }

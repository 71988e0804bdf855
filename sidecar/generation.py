"""What the proxy serves with: one config *generation*, and the process-wide runtime.

A :class:`Generation` is everything built from one validated config (route
table, upstream clients, breakers). A config reload builds a new generation and
swaps :attr:`Runtime.current` in one assignment; requests already running keep
the generation they started with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from random import Random
from typing import TYPE_CHECKING

from sidecar.breakers.credentials import CredentialBreakers
from sidecar.breakers.live import LiveBreakers
from sidecar.breakers.machine import BreakerSettings, BreakerState, Override, Target
from sidecar.breakers.port import BreakerPort
from sidecar.breakers.window import FailureWindow
from sidecar.clock import Clock
from sidecar.config import Config
from sidecar.routes import RouteTable
from sidecar.target_stats import TargetStats
from sidecar.upstream import Upstream

if TYPE_CHECKING:
    from sidecar.fleet.runtime import Fleet


def breaker_settings(config: Config) -> dict[Target, BreakerSettings]:
    """Breaker settings of every configured target whose upstream has a ``circuit_breaker``.

    Targets are (upstream, candidate model or ``*``) from the routes' candidates.
    """
    out: dict[Target, BreakerSettings] = {}
    for route in config.routes:
        for cand in route.candidates:
            cb = config.upstreams[cand.upstream].circuit_breaker
            if cb is None:
                continue
            out[Target(cand.upstream, cand.model or "*")] = BreakerSettings(
                failure_threshold=cb.failure_threshold,
                cooldown_s=cb.cooldown_s,
                half_open_max_probes=cb.half_open_max_probes,
                success_threshold=cb.success_threshold,
                failure_rate=cb.failure_rate_threshold,
                window_s=cb.window_ms / 1000,
                minimum_calls=cb.minimum_calls,
                ramp_s=cb.ramp_ms / 1000,
            )
    return out


def credential_scopes(config: Config, targets: Iterable[Target]) -> dict[Target, str]:
    """Per target (of ``targets``) whose upstream has ``rate_limit_scope = "credential"``
    (the default without ``api_key_env``), the header holding the caller's credential:
    the upstream's ``auth_header``."""
    out: dict[Target, str] = {}
    for target in targets:
        up = config.upstreams[target.upstream]
        if up.rate_limits_per_credential:
            out[target] = up.auth_header.lower()
    return out


def _stats(
    config: Config,
    settings: Mapping[Target, BreakerSettings],
    carried: Mapping[Target, TargetStats],
    kept: Mapping[Target, BreakerState],
) -> dict[Target, TargetStats]:
    """The per-target statistics of a new generation: a carried object where there is
    one (calls in flight settle on it), with the failure-rate window kept only for a
    breaker the reload kept (``kept``), else a new window (or none)."""
    wanted = {
        Target(c.upstream, c.model or "*")
        for r in config.routes
        if any(c.tier is not None for c in r.candidates)  # a route with tiers
        for c in r.candidates
    }
    wanted.update(t for t, cfg in settings.items() if cfg.failure_rate > 0)
    out: dict[Target, TargetStats] = {}
    for target in wanted:
        st = carried.get(target) or TargetStats()
        st.capacity = config.upstreams[target.upstream].max_connections
        cfg = settings.get(target)
        if cfg is None or cfg.failure_rate <= 0:
            st.window = None
        elif st.window is None or target not in kept:
            st.window = FailureWindow(cfg.window_s)
        out[target] = st
    return out


class Generation:
    """Route table, upstreams and breakers built from one :class:`Config`.

    :param config: a validated config.
    :param environ: where ``api_key_env`` variables are read (values never logged).
    :param clock: the injected clock.
    :param keep: breaker states to carry over (reload), by target.
    :param fleet: the process's fleet (``[fleet]``), whose breakers share decisions.
    :param stats: the chooser's per-target statistics to carry over (reload), by target.
    :param rand: the random source of the chooser and of the retry backoff's jitter (a
        seeded one in tests).
    :param credentials: the breakers of (target, credential) to carry over (reload):
        those of the kept targets (``keep``).
    :param overrides: operators' overrides to carry over (reload) onto targets whose
        breaker is not kept (its settings changed).
    """

    def __init__(
        self,
        config: Config,
        environ: Mapping[str, str],
        clock: Clock,
        keep: Mapping[Target, BreakerState] | None = None,
        fleet: Fleet | None = None,
        stats: Mapping[Target, TargetStats] | None = None,
        rand: Random | None = None,
        credentials: CredentialBreakers | None = None,
        overrides: Mapping[Target, Override] | None = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.clock = clock
        settings = breaker_settings(config)
        self.stats = _stats(config, settings, stats or {}, keep or {})
        """Load, time to first output and failure-rate window of every member of a route
        with tiers and every target with a failure-rate breaker; the same objects
        across a reload (a retired generation's calls settle on them)."""
        self.routes = RouteTable(config, self.stats)
        self.random = rand or Random()
        """The chooser's random source (:func:`sidecar.choice.choose`), also the jitter's."""
        self.draw = self.random.random
        """:attr:`random`'s draw in [0, 1), bound once (the chooser's ``draw``, and the
        retry backoff's jitter: :meth:`sidecar.upstream.Upstream.retry_wait`)."""
        self.upstreams = {
            name: Upstream(
                name,
                u,
                environ.get(u.api_key_env) if u.api_key_env else None,
                environ,
                self.draw,
            )
            for name, u in config.upstreams.items()
        }
        windows = {t: st.window for t, st in self.stats.items() if st.window is not None}
        scopes = credential_scopes(config, settings)
        local = LiveBreakers(settings, clock, keep, windows, scopes, credentials, overrides)
        self.breakers: BreakerPort = local
        """What the proxy asks: this member's own breakers, used directly (no layer in
        between), or with ``[fleet]`` a :class:`~sidecar.fleet.breakers.FleetBreakers`
        holding them, whose fleet member adopts them (the newest generation's)."""
        if fleet is not None:
            from sidecar.fleet.breakers import FleetBreakers  # imported only with [fleet]

            self.breakers = FleetBreakers(local, fleet.adopt(config, settings, local, keep or {}))
        self.users = 0
        """Requests currently using this generation."""
        self.owns_breakers = True
        """False once retired: :attr:`breakers` is then the current generation's."""

    def pool_full(self, upstream: str) -> bool:
        """Whether ``upstream``'s connection pool has every one of its
        ``max_connections`` busy (:func:`sidecar.choice.choose` asks)."""
        return self.upstreams[upstream].full

    async def start(self) -> None:
        """Open the upstream client sessions."""
        for up in self.upstreams.values():
            await up.start()

    async def close(self) -> None:
        """Stop the breaker timer (its own) and close every upstream connection."""
        if self.owns_breakers:
            self.breakers.close()
        for up in self.upstreams.values():
            await up.close()


class Runtime:
    """Process-wide proxy state: the current generation, in-flight count, draining flag."""

    def __init__(self, generation: Generation) -> None:
        self.current = generation
        self.inflight = 0
        self.draining = False
        self.listening = False
        self.admin_token: str | None = None
        """The admin port's token (``server.admin_token_env``'s value), read at start and
        on each reload; None: the write endpoints do not exist."""
        self.retired: set[Generation] = set()
        self._closing: set[asyncio.Task[None]] = set()

    def retire(self, gen: Generation) -> None:
        """Close ``gen`` once no request uses it any more (after a reload swapped it out
        for :attr:`current`).

        Its requests still in flight settle their permits, and admit further candidates,
        on the current generation's breakers (contract, "Reload": a breaker whose target
        and settings are unchanged is kept exactly as it is, a probe in flight with its
        slot; its states were carried over with their generations, so those permits are
        current there). A permit of a target whose breaker was reset or removed is stale
        there and changes nothing, as the old instance's results used to.
        """
        if gen.owns_breakers:
            gen.breakers.close()
            gen.owns_breakers = False
        for old in (gen, *self.retired):
            old.breakers = self.current.breakers
        self.retired.add(gen)
        self.release(gen)

    def release(self, gen: Generation) -> None:
        """Called when a request using ``gen`` ends: close a retired, unused generation."""
        if gen.users == 0 and gen in self.retired:
            self.retired.discard(gen)
            task = asyncio.get_running_loop().create_task(gen.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close the current generation and every retired one (shutdown)."""
        for gen in [self.current, *self.retired]:
            await gen.close()
        self.retired.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

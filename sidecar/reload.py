"""Live config reload: watch the config file, validate, swap generations.

Kubernetes updates a mounted ConfigMap in place by swapping a symlink
(``..data``); the file's path stays the same and its bytes change. The
:class:`ConfigWatcher` polls the file's bytes every ``interval_s`` seconds
(polling follows symlink swaps, which inotify on the file itself does not) and
SIGHUP asks for a reload at once.

A reload (:func:`reload_runtime`) never drops anything in flight:

* the new config is validated first; an invalid one is refused, the old one
  keeps serving, the error is logged with its key path and counted
  (``sidecar_config_reloads_total{result="error"}``);
* a new :class:`~sidecar.generation.Generation` is built and swapped in with one
  assignment; requests and streams already running finish on the generation
  they started with, whose upstream connections close when its last request ends;
* breaker state survives, exactly as it is, for targets that still exist with the
  same breaker settings: counts, times, a half-open probe in flight with its slot
  (contract, "Reload": a reload never lets a second probe through), the failure-rate
  window; requests of the old generation settle their permits on the new breakers
  (:meth:`~sidecar.generation.Runtime.retire`); removed targets leave ``/status`` and the metrics;
  new ones start closed. Targets that stay but whose breaker settings changed
  start closed too; the ``config_reloaded`` line names them (``breakers_reset``);
* an operator's override (``POST /breakers/...``) stays in force, with its end, on
  every target that still has a breaker, a reset one included; a removed target's
  goes with it. The admin token (``server.admin_token_env``) is read again.

``server.listen`` and ``server.admin_listen`` cannot move while serving, nor can
``[tracing]``: a change to them is logged as a warning and takes effect at the next
restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence

from sidecar import logs, metrics
from sidecar.breakers.machine import BreakerState, Override, Target
from sidecar.config import ConfigError, load_config_with_warnings, missing_api_key_envs
from sidecar.generation import Generation, Runtime, breaker_settings
from sidecar.override_request import admin_token

RELOAD_RESULTS = ("success", "unchanged", "error")
"""The ``result`` values of ``sidecar_config_reloads_total``."""

# Every result's series exists, at 0, from start-up: a dashboard or an alert on
# `increase(...{result="error"}[..])` then sees the first failed reload too (a
# counter that appears at 1 has no increase to show).
for _result in RELOAD_RESULTS:
    metrics.CONFIG_RELOADS.labels(_result)


def log_config_warnings(warnings: Sequence[tuple[str, str]]) -> None:
    """One ``config_warning`` line at ``warning`` per warning of a config that loaded
    (:mod:`sidecar.config.lint`: an unused upstream, an unreachable route), with its
    ``key`` path and ``detail``: at start (:func:`sidecar.cli.serve`) and after each
    reload that swaps a config in."""
    for key, detail in warnings:
        logs.event("config_warning", level=logging.WARNING, key=key, detail=detail)


async def reload_runtime(rt: Runtime, path: str | None, environ: Mapping[str, str]) -> bool:
    """Reload the config at ``path`` into ``rt``; True when the new config was swapped in.

    Never raises for a bad config: it is logged (``config_reload_failed`` with
    every error line) and counted, and the current generation keeps serving.
    """
    old = rt.current
    try:
        config, warnings = load_config_with_warnings(path, environ)
        missing = missing_api_key_envs(config, environ)
        if missing:
            raise ConfigError(
                [
                    f"upstreams.{up}.api_key_env: variable {var} is not set or empty"
                    for up, var in missing
                ]
            )
    except ConfigError as exc:
        metrics.CONFIG_RELOADS.labels("error").inc()
        logs.event("config_reload_failed", level=40, errors=exc.errors)
        return False
    if config == old.config:
        metrics.CONFIG_RELOADS.labels("unchanged").inc()
        return False
    old_settings = breaker_settings(old.config)
    new_settings = breaker_settings(config)
    keep: dict[Target, BreakerState] = {
        t: st
        for t, st in old.breakers.states()
        if new_settings.get(t) is not None and new_settings.get(t) == old_settings.get(t)
    }
    # An operator's override outlives a reload on every target that still has a breaker,
    # also one whose settings changed (its counts start again, the override does not).
    overrides: dict[Target, Override] = {
        t: st.override
        for t, st in old.breakers.states()
        if st.override is not None and t in new_settings and t not in keep
    }
    gen = Generation(
        config,
        environ,
        old.clock,
        keep,
        fleet=old.fleet,
        stats=old.stats,
        rand=old.random,
        credentials=old.breakers.credentials,
        overrides=overrides,
    )
    await gen.start()
    removed = set(old_settings) - set(new_settings)
    reset = sorted(t for t, new in new_settings.items() if old_settings.get(t) not in (None, new))
    metrics.forget_breakers(removed)
    rt.current = gen
    rt.admin_token = admin_token(config.server.admin_token_env, environ)
    rt.retire(old)
    metrics.CONFIG_RELOADS.labels("success").inc()
    log_config_warnings(warnings)
    s_old, s_new = old.config.server, config.server
    if (s_old.listen, s_old.admin_listen) != (s_new.listen, s_new.admin_listen):
        logs.event("config_listen_changed_needs_restart", level=30)
    if old.config.tracing != config.tracing:  # the tracer is the process's, made at start
        logs.event("config_tracing_changed_needs_restart", level=30)
    logs.event(
        "config_reloaded",
        targets_kept=len(keep),
        targets_added=len(set(new_settings) - set(old_settings)),
        targets_removed=len(removed),
        # Targets that exist before and after with changed breaker settings start
        # closed again: name them, since their open/half-open state was dropped.
        breakers_reset=[{"upstream": t.upstream, "model": t.model} for t in reset],
    )
    return True


class ConfigWatcher:
    """Polls a config file and reloads ``rt`` when its bytes change; SIGHUP via :meth:`trigger`.

    :param rt: the runtime to reload.
    :param path: the config file (a Kubernetes ConfigMap mount path works).
    :param environ: where ``api_key_env`` variables are read.
    :param interval_s: seconds between polls (real time; the watcher is IO).
    """

    def __init__(
        self, rt: Runtime, path: str, environ: Mapping[str, str], interval_s: float = 2.0
    ) -> None:
        self.rt = rt
        self.path = path
        self.environ = environ
        self.interval_s = interval_s
        self._last = self._read()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()

    def _read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except OSError:
            return None

    def start(self) -> None:
        """Start polling in a background task."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    def trigger(self) -> None:
        """Reload now (SIGHUP), even if the bytes look unchanged."""
        self._last = None
        self._wake.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
            self._wake.clear()
            data = self._read()
            if data is None or data == self._last:
                continue
            self._last = data
            await reload_runtime(self.rt, self.path, self.environ)
            self.changed.set()

    async def stop(self) -> None:
        """Stop polling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

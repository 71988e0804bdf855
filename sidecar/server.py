"""Running the sidecar: the proxy and admin servers, start-up and drain.

:class:`Sidecar` is what ``sidecar serve`` runs and what tests and the demo
start in-process on loopback port 0.

Shutdown order (contract, "Shutdown"; as uvicorn does it): readiness turns 503
at once, the proxy listener stops accepting, in-flight requests and streams get
``drain_timeout_ms`` to finish, the rest are cancelled (their client
connections aborted, never ended cleanly), then upstream connections close.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Awaitable, Mapping
from random import Random
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web

from sidecar import logs
from sidecar.admin import create_admin_app
from sidecar.clock import Clock, LoopClock
from sidecar.collector import tune_for_serving
from sidecar.config import Config
from sidecar.config import split_host_port as split_listen
from sidecar.generation import Generation, Runtime
from sidecar.metrics import Recorder
from sidecar.override_request import admin_token
from sidecar.proxy import Proxy
from sidecar.reload import ConfigWatcher, reload_runtime
from sidecar.wire import ProxyServer

if TYPE_CHECKING:
    from sidecar.fleet.runtime import Fleet
    from sidecar.tracing.runtime import Tracing

_Runner = TypeVar("_Runner", bound="web.BaseRunner")

STOP_AFTER_DRAIN_S = 0.5
"""Seconds the steps after the drain may take together (:meth:`Sidecar.stop`)."""


async def _bounded(step: str, aw: Awaitable[None], deadline: float) -> None:
    """Await ``aw`` until ``deadline`` (loop time); past it, leave it running, log it.

    The step runs as its own task and is waited for with :func:`asyncio.wait`, not
    cancelled into: a step that does not end when cancelled (a client library that
    swallows the cancellation) cannot hold the caller. An error in a step is logged
    and the stop goes on.
    """
    task = asyncio.ensure_future(aw)
    remaining = max(0.0, deadline - asyncio.get_running_loop().time())
    done, _ = await asyncio.wait({task}, timeout=remaining)
    if not done:
        task.cancel()
        logs.event("stop_step_timeout", level=logging.WARNING, step=step, pending=pending_tasks())
        return
    exc = task.exception()
    if exc is not None:
        logs.event("stop_step_failed", level=logging.WARNING, step=step, error=type(exc).__name__)


def pending_tasks() -> list[str]:
    """Every other task of the running loop, as ``name: coroutine at file:line`` (where it
    waits): what holds a stop, for the log."""
    out = []
    current = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is current or task.done():
            continue
        stack = task.get_stack(limit=1)
        where = (
            f"{stack[-1].f_code.co_filename.rsplit('/', 1)[-1]}:{stack[-1].f_lineno}"
            if stack
            else "?"
        )
        coro = task.get_coro()
        name = getattr(coro, "__qualname__", type(coro).__name__)
        out.append(f"{task.get_name()}: {name} at {where}")
    return sorted(out)


class Sidecar:
    """The proxy and admin servers for one config.

    :param config: a validated :class:`~sidecar.config.Config`.
    :param environ: where ``api_key_env`` values are read.
    :param clock: injected clock (default: the event loop's).
    :param proxy_listen: override ``server.listen`` (``"127.0.0.1:0"`` in tests).
    :param admin_listen: override ``server.admin_listen``.
    :param config_path: the file ``config`` came from; when given, it is watched
        and reloaded live (see :mod:`sidecar.reload`), and :meth:`reload` re-reads it.
    :param watch_interval_s: seconds between polls of ``config_path``.
    :param rand: the random source of the tier chooser (default: a fresh, unseeded one).
    """

    def __init__(
        self,
        config: Config,
        *,
        environ: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        proxy_listen: str | None = None,
        admin_listen: str | None = None,
        config_path: str | None = None,
        watch_interval_s: float = 2.0,
        rand: Random | None = None,
    ) -> None:
        self.config = config
        self.environ = os.environ if environ is None else environ
        self.clock: Clock = clock or LoopClock()
        self.random = rand or Random()
        self.proxy_listen = proxy_listen or config.server.listen
        self.admin_listen = admin_listen or config.server.admin_listen
        self.runtime: Runtime | None = None
        self.config_path = config_path
        self.watch_interval_s = watch_interval_s
        self.watcher: ConfigWatcher | None = None
        self._proxy_runner: web.ServerRunner | None = None
        self.connections: ProxyServer | None = None
        """The proxy port's server: its client connections and their request-head deadlines."""
        self._admin_runner: web.AppRunner | None = None
        self.recorder = Recorder()
        """Where the proxy reports its metrics."""
        self.proxy_port = 0
        self.admin_port = 0
        self.fleet: Fleet | None = None
        """The fleet (``[fleet]``), once started."""
        self.tracing: Tracing | None = None
        """The tracer (``[tracing]``), once started; None without that table."""

    @property
    def proxy_url(self) -> str:
        """``http://host:port`` of the proxy port."""
        return f"http://{_url_host(self.proxy_listen)}:{self.proxy_port}"

    @property
    def admin_url(self) -> str:
        """``http://host:port`` of the admin port."""
        return f"http://{_url_host(self.admin_listen)}:{self.admin_port}"

    async def start(self) -> None:
        """Open upstream sessions, bind both ports; readiness turns 200 once listening.

        :raises ListenError: a port cannot be bound (everything opened so far is closed).
        """
        fleet = None
        if self.config.fleet is not None:  # imported only then: no cost without [fleet]
            from sidecar.fleet.runtime import Fleet

            fleet = Fleet.from_config(self.config, self.environ, self.clock)
        self.fleet = fleet
        if self.config.tracing is not None:  # imported only then: no OpenTelemetry without it
            from sidecar.tracing.runtime import Tracing

            self.tracing = Tracing(self.config)
        gen = Generation(self.config, self.environ, self.clock, fleet=fleet, rand=self.random)
        await gen.start()
        self.runtime = rt = Runtime(gen)
        rt.admin_token = admin_token(self.config.server.admin_token_env, self.environ)
        if self.config.server.admin_token_env and rt.admin_token is None:
            logs.event(
                "config_warning",
                level=logging.WARNING,
                key="server.admin_token_env",
                detail=f"variable {self.config.server.admin_token_env} is not set or empty: "
                "POST /breakers/... does not exist (no operator overrides)",
            )
        try:
            await self._listen(rt)
        except BaseException:
            # Nothing half-started is left behind (no "Unclosed client session").
            if self._admin_runner is not None:
                await self._admin_runner.cleanup()
                self._admin_runner = None
            await rt.close()
            self.runtime = None
            if self.tracing is not None:
                await self.tracing.shutdown(0.0)
                self.tracing = None
            raise
        rt.listening = True
        if fleet is not None:
            fleet.start()  # background only: never waits for the store
        if self.config_path is not None:
            self.watcher = ConfigWatcher(rt, self.config_path, self.environ, self.watch_interval_s)
            self.watcher.start()
        logs.event("started", proxy_port=self.proxy_port, admin_port=self.admin_port)

    async def _listen(self, rt: Runtime) -> None:
        drain_s = self.config.server.drain_timeout_ms / 1000
        admin = web.AppRunner(
            create_admin_app(rt), access_log=None, shutdown_timeout=1.0, logger=logs.HTTP_LOGGER
        )
        self._admin_runner = await _start(admin, self.admin_listen, what="admin_listen")
        self.admin_port = _bound_port(self._admin_runner)
        # aiohttp's low-level server: no Application, router or middleware on the
        # hot path. ProxyServer adds the request-head deadline aiohttp lacks.
        self.connections = ProxyServer(
            Proxy(rt, self.recorder, self.tracing).handle,
            clock=self.clock,
            timeout_s=lambda: rt.current.config.server.client_read_timeout_s,
            access_log=None,
            logger=logs.HTTP_LOGGER,
            auto_decompress=False,  # a compressed request body is relayed as it came
        )
        proxy = web.ServerRunner(self.connections, shutdown_timeout=drain_s)
        self._proxy_runner = await _start(proxy, self.proxy_listen, what="listen")
        self.proxy_port = _bound_port(self._proxy_runner)

    async def reload(self) -> bool:
        """Re-read the config file now (SIGHUP); True when a new config was swapped in."""
        assert self.runtime is not None
        return await reload_runtime(self.runtime, self.config_path, self.environ)

    async def stop(self) -> None:
        """Drain and stop (see the module docstring). Safe to call once after :meth:`start`.

        Bounded (contract, "Shutdown": the process exits within ``drain_timeout_ms`` +
        1 s whatever its upstreams and the fleet's store do): in-flight requests get
        ``drain_timeout_ms``, every later step (the proxy's last cleanup, the config
        watcher, upstream connections, the fleet, the admin port, and with
        ``[tracing]`` the last spans' export, at most 1 s of it) shares
        :data:`STOP_AFTER_DRAIN_S` more. A step still running then is left behind and
        logged as ``stop_step_timeout`` with the tasks still pending and where each
        waits (``sidecar serve``'s watchdog then ends the process).
        """
        loop = asyncio.get_running_loop()
        drain_s = self.config.server.drain_timeout_s
        deadline = loop.time() + drain_s + STOP_AFTER_DRAIN_S
        rt = self.runtime
        if rt is not None:
            rt.draining = True
            logs.event("draining", inflight=rt.inflight)
        if self._proxy_runner is not None:
            # aiohttp's cleanup waits up to shutdown_timeout for handlers, then up to
            # shutdown_timeout again before cancelling them (2x drain_timeout_ms in
            # all): abort the connections still open at drain_timeout_ms instead,
            # which cancels their handlers (a truncated stream never ends cleanly).
            cleanup = asyncio.ensure_future(self._proxy_runner.cleanup())
            done, _ = await asyncio.wait({cleanup}, timeout=drain_s)
            if not done and self.connections is not None:
                logs.event("drain_timeout", aborted=self.connections.abort_all())
            await _bounded("proxy_cleanup", cleanup, deadline)
        if self.watcher is not None:
            await _bounded("config_watcher", self.watcher.stop(), deadline)
        if rt is not None:
            await _bounded("upstreams", rt.close(), deadline)
        if self.fleet is not None:
            await _bounded("fleet", self.fleet.stop(), deadline)
        if self._admin_runner is not None:
            await _bounded("admin", self._admin_runner.cleanup(), deadline)
        if self.tracing is not None:  # every request has ended: its spans too
            await _bounded("tracing", self.tracing.shutdown(deadline - loop.time()), deadline)
        logs.event("stopped")

    async def __aenter__(self) -> Sidecar:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _url_host(listen: str) -> str:
    host, _ = split_listen(listen)
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class ListenError(OSError):
    """A listen address could not be opened (in use, not permitted, unknown host).

    ``key`` is the config key (``listen`` or ``admin_listen``), ``listen`` the address,
    ``reason`` the OS's words (``"Address already in use"``), ``code`` the errno name
    (``"EADDRINUSE"``) or None.
    """

    def __init__(self, key: str, listen: str, exc: OSError) -> None:
        self.key = key
        self.listen = listen
        n = exc.errno if exc.errno is not None and exc.errno > 0 else 0
        self.code = errno.errorcode.get(n) if n else None
        self.reason = os.strerror(n) if self.code else str(exc)
        super().__init__(exc.errno, f"server.{key} {listen}: {self.reason}")


async def _start(runner: _Runner, listen: str, *, what: str) -> _Runner:
    """Set up ``runner`` and bind it on ``listen`` (the config key ``server.<what>``).

    :raises ListenError: the address cannot be opened (the runner is cleaned up).
    """
    await runner.setup()
    host, port = split_listen(listen)
    bound = web.TCPSite(runner, host or None, port)
    try:
        await bound.start()
    except BaseException as exc:
        await runner.cleanup()
        if isinstance(exc, OSError):
            raise ListenError(what, listen, exc) from None
        raise
    return runner


def _bound_port(runner: web.BaseRunner) -> int:
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            return int(addr[1])
    raise RuntimeError("no TCP address bound")


async def serve_until_signal(sidecar: Sidecar, stop: asyncio.Event) -> None:
    """Start ``sidecar``, tune the collector for serving
    (:func:`sidecar.collector.tune_for_serving`), wait for ``stop``, then drain and stop."""
    await sidecar.start()
    tune_for_serving()
    try:
        await stop.wait()
    finally:
        await sidecar.stop()

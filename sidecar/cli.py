"""Command line: ``sidecar serve | check-config | demo | breaker | --version`` (contract,
"Command line"; ``breaker``: :mod:`sidecar.breaker_cli`).

Argument parsing, logging set-up and exit codes only: 0 clean stop, 2 bad config
or usage (a missing ``api_key_env`` variable included), 1 anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence

from sidecar import __version__, logs
from sidecar.config import (
    Config,
    ConfigError,
    LoadedConfig,
    load_config_with_warnings,
    missing_api_key_envs,
    render_effective,
    resolve_config_path,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sidecar", description="Circuit-breaking LLM API sidecar")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the proxy and admin servers until SIGTERM/SIGINT")
    s.add_argument(
        "--config",
        help="config file (default: $SIDECAR_CONFIG, /etc/sidecar/sidecar.toml, embedded)",
    )
    c = sub.add_parser("check-config", help="validate a config and print it with secrets redacted")
    c.add_argument("path", nargs="?", help="config file (default: as for serve)")
    d = sub.add_parser("demo", help="a self-contained show on loopback, under 60 s")
    d.add_argument("--seconds", type=float, default=30.0, help="how long the traffic runs")
    b = sub.add_parser(
        "breaker", help="an operator's override of a running sidecar's breaker (admin port)"
    )
    b.add_argument(
        "verb", choices=("open", "close", "auto"), help="force_open | force_closed | auto"
    )
    b.add_argument("upstream", help="the upstream's name in the config")
    b.add_argument("model", help="the candidate's model, or '*' for a candidate without one")
    b.add_argument("--reason", help="why (required for open and close; shown in /status)")
    b.add_argument("--for", dest="for_", metavar="DURATION", help="end by itself: 90s, 10m, 2h")
    b.add_argument("--config", help="config file (default: as for serve): token variable, port")
    b.add_argument("--admin", metavar="URL", help="the admin port (default: server.admin_listen)")
    b.add_argument("--json", action="store_true", help="print the target's /status entry as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sidecar`` console script; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code in (0, None) else EXIT_USAGE
    if args.command == "check-config":
        return check_config(args.path)
    if args.command == "serve":
        return serve(args.config)
    if args.command == "demo":
        from sidecar.demo import run_demo

        return run_demo(args.seconds)
    if args.command == "breaker":
        return breaker(args)
    return EXIT_USAGE  # pragma: no cover (argparse requires a command)


def _load(path: str | None) -> tuple[LoadedConfig, str | None] | None:
    """The config from ``path`` (or the usual lookup) with its warnings, and its source;
    None after printing every error to stderr."""
    source = resolve_config_path(path, os.environ)
    try:
        return load_config_with_warnings(source, os.environ), source
    except ConfigError as exc:
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        return None


def _fleet_problems(config: Config, environ: Mapping[str, str]) -> list[str]:
    """``[fleet]``'s Redis URL variable problems (:func:`sidecar.fleet.fleet_env_problems`);
    ``[]`` without ``[fleet]``, whose modules are then never imported."""
    if config.fleet is None:
        return []
    from sidecar.fleet import fleet_env_problems

    return fleet_env_problems(config, environ)


def check_config(path: str | None) -> int:
    """Validate; print the effective config (secrets redacted) on stdout, and on stderr
    each warning (``warning: key.path: message``: :mod:`sidecar.config.lint`, unset
    variables) then :func:`summary`; or every error on stderr. Exit 0 / 2 (warnings
    never change it)."""
    environ = os.environ
    loaded = _load(path)
    if loaded is None:
        return EXIT_USAGE
    (config, warnings), source = loaded
    for key, message in warnings:
        print(f"warning: {key}: {message}", file=sys.stderr)
    for upstream, var in missing_api_key_envs(config, environ):
        print(
            f"warning: upstreams.{upstream}.api_key_env: variable {var} is not set or empty "
            "(sidecar serve will refuse to start without it)",
            file=sys.stderr,
        )
    from sidecar.egress import problems as egress_problems  # (imports aiohttp)

    for problem in _fleet_problems(config, environ) + egress_problems(config, environ):
        print(f"warning: {problem} (sidecar serve will refuse to start)", file=sys.stderr)
    if (off := admin_token_off(config, environ)) is not None:
        print(f"warning: {off}", file=sys.stderr)
    print(f"# source: {source or '<embedded default>'}")
    print(render_effective(config), end="")
    print(summary(config), file=sys.stderr)
    return EXIT_OK


def breaker(args: argparse.Namespace) -> int:
    """``sidecar breaker open|close|auto UPSTREAM MODEL``: :mod:`sidecar.breaker_cli`
    (its exit codes: 0 done, 2 usage or config, 3 unreachable, 4 token refused, 5 not
    found, 1 anything else)."""
    loaded = _load(args.config)
    if loaded is None:
        return EXIT_USAGE
    (config, _), _ = loaded
    from sidecar.breaker_cli import run

    return run(
        args.verb,
        args.upstream,
        args.model,
        config=config,
        environ=os.environ,
        reason=args.reason,
        for_=args.for_,
        admin=args.admin,
        as_json=args.json,
    )


def admin_token_off(config: Config, environ: Mapping[str, str]) -> str | None:
    """``server.admin_token_env: ...`` when it names a variable that is unset or empty
    (the admin port's ``POST /breakers/...`` then does not exist: not an error), else
    None. The value is never echoed."""
    var = config.server.admin_token_env
    if not var or environ.get(var):
        return None
    return (
        f"server.admin_token_env: variable {var} is not set or empty "
        "(POST /breakers/... will not exist: no operator overrides)"
    )


def summary(config: Config) -> str:
    """``config ok: N upstreams, M routes, K breakers`` (contract, "Command line"): K is
    the number of targets (upstream, candidate model) whose upstream has a breaker."""
    from sidecar.generation import breaker_settings

    return (
        f"config ok: {len(config.upstreams)} upstreams, {len(config.routes)} routes, "
        f"{len(breaker_settings(config))} breakers"
    )


def event_loop_runner() -> asyncio.Runner:
    """An :class:`asyncio.Runner` on uvloop when it is installed, else on asyncio's own loop.

    uvloop (libuv) is optional (``pip install 'llm-circuit-sidecar[uvloop]'``); everything
    works without it.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def serve(path: str | None) -> int:
    """Run until SIGTERM/SIGINT, then drain; exit 0, or 2 on a bad config. The config's
    warnings are logged first (``config_warning``), before ``config_loaded``."""
    environ = os.environ
    loaded = _load(path)
    if loaded is None:
        return EXIT_USAGE
    (config, warnings), source = loaded
    missing = missing_api_key_envs(config, environ)
    problems = [
        f"upstreams.{up}.api_key_env: variable {var} is not set or empty" for up, var in missing
    ]
    problems += _fleet_problems(config, environ)
    from sidecar.egress import problems as egress_problems  # (imports aiohttp)

    problems += egress_problems(config, environ)
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_USAGE
    logs.setup(config.server.log_level)
    from sidecar.reload import log_config_warnings
    from sidecar.server import ListenError

    log_config_warnings(warnings)

    try:
        with event_loop_runner() as runner:
            runner.run(_serve(config, source))
    except ListenError as exc:
        # Contract ("Logs"): one error line naming the cause, exit 1, nothing on stderr.
        logs.event(
            "start_failed",
            level=logging.ERROR,
            key=f"server.{exc.key}",
            listen=exc.listen,
            error=exc.code or "OSError",
            detail=exc.reason,
        )
        return EXIT_FAILURE
    except OSError as exc:
        logs.event("start_failed", level=logging.ERROR, error=type(exc).__name__, detail=str(exc))
        return EXIT_FAILURE
    return EXIT_OK


async def _serve(config: Config, source: str | None) -> None:
    from sidecar.server import Sidecar, serve_until_signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sidecar = Sidecar(config, config_path=source)

    def on_hup() -> None:
        if sidecar.watcher is not None:
            sidecar.watcher.trigger()

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    logs.event("config_loaded", source=source or "<embedded default>")
    watchdog = asyncio.ensure_future(_arm_exit_watchdog(stop, config.server.drain_timeout_s))
    try:
        await serve_until_signal(sidecar, stop)
    finally:
        watchdog.cancel()


EXIT_WATCHDOG_MARGIN_S = 0.9
"""After SIGTERM, the process ends by force at ``drain_timeout_ms`` + this (seconds)."""


async def _arm_exit_watchdog(stop: asyncio.Event, drain_s: float) -> None:
    """Once ``stop`` is set (SIGTERM, SIGINT), start a thread that ends the process at
    ``drain_s`` + :data:`EXIT_WATCHDOG_MARGIN_S` if it is still running then.

    Contract, "Shutdown": the process exits within ``drain_timeout_ms`` + 1 s whatever
    its upstreams and the fleet's store do. The drain and stop are bounded on the loop
    (:meth:`sidecar.server.Sidecar.stop`); this covers what the loop cannot bound: a
    task that ignores its cancellation at the runner's last cleanup, a blocked loop, a
    resolver thread the executor's shutdown waits for. It logs ``exit_forced`` and
    exits 0 (the drain is over; nothing is left to end cleanly).
    """
    await stop.wait()
    timer = threading.Timer(drain_s + EXIT_WATCHDOG_MARGIN_S, _force_exit)
    timer.daemon = True
    timer.start()


def _force_exit() -> None:
    logs.event("exit_forced", level=logging.WARNING)  # writes held access lines first
    if logs.STDOUT_HANDLER is not None:
        logs.STDOUT_HANDLER.flush()
    sys.stdout.flush()
    os._exit(EXIT_OK)

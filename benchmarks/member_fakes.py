"""Fake upstream members in one child process, driven over its stdin.

``balance.py``, ``load_bounds.py`` and ``hedging.py`` each run their fake providers
(one aiohttp server per member on a free loopback port) in a child process started
with ``SCRIPT fake SPEC_JSON``; the benchmark then steers them with one-line commands:

* ``set NAME key=value ...``: :meth:`Member.set` on that member;
* ``stats``: ``{"members": {name: stats(member)}}``;
* ``reset``: ``reset(member)`` on each one;
* any command of ``commands``: ``commands[cmd](members)``.

Each reply is one JSON line with ``at`` (the child's monotonic clock) added.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import benchlib as bl
from aiohttp import web


class Member(Protocol):
    """A fake member: a name and settings a ``set`` command changes."""

    name: str

    def set(self, **kv: str) -> None: ...


M = TypeVar("M", bound=Member)


async def serve_members(
    members: Sequence[M],
    handle: Callable[[web.Request], Awaitable[web.StreamResponse]],
    key: web.AppKey[M],
    stats: Callable[[M], Any],
    reset: Callable[[M], None],
    commands: Mapping[str, Callable[[dict[str, M]], None]] | None = None,
    handler_cancellation: bool = False,
) -> None:
    """Serve each of ``members`` with ``handle`` (its member at ``request.app[key]``),
    print ``listening {name: port}``, then answer stdin's commands until it closes.

    :param handler_cancellation: aiohttp's option: a handler ends when the client (the
        sidecar) closes its connection (a hedge's loser, a stalled call let go).
    """
    by_name: dict[str, M] = {}
    ports: dict[str, int] = {}
    runners = []
    for m in members:
        app = web.Application()
        app[key] = m
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False,
                               handler_cancellation=handler_cancellation)  # fmt: skip
        await runner.setup()
        site = web.TCPSite(runner, bl.LOOPBACK, 0)
        await site.start()
        runners.append(runner)
        server = site._server
        assert server is not None
        by_name[m.name] = m
        ports[m.name] = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    print("listening " + json.dumps(ports), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        cmd, *rest = line.split()
        reply: Any = {"at": time.monotonic()}
        if cmd == "set":
            by_name[rest[0]].set(**dict(kv.split("=", 1) for kv in rest[1:]))
        elif cmd == "stats":
            reply["members"] = {n: stats(m) for n, m in by_name.items()}
        elif cmd == "reset":
            for m in by_name.values():
                reset(m)
        elif commands is not None and cmd in commands:
            commands[cmd](by_name)
        print(json.dumps(reply), flush=True)
    for runner in runners:
        await runner.cleanup()


def start_fake(
    procs: bl.Procs, script: str, name: str, spec: list[dict[str, Any]]
) -> tuple[bl.Proc, dict[str, int]]:
    """Start ``script fake SPEC`` as ``name`` under ``procs``; its process and the port
    of each member, by name.

    :raises RuntimeError: the child did not say ``listening`` first (see its log).
    """
    cmd = [bl.PY, str(Path(script).resolve()), "fake", json.dumps(spec)]
    proc = procs.start(name, cmd, control=True)
    assert proc.popen.stdout is not None
    line = proc.popen.stdout.readline().strip()
    if not line.startswith("listening "):
        raise RuntimeError(f"{name} did not start: {line!r}; see {proc.log}")
    ports: dict[str, int] = json.loads(line.split(" ", 1)[1])
    return proc, ports


def fake_cmd(proc: bl.Proc, line: str) -> dict[str, Any]:
    """Send one command line to the fakes; their JSON reply."""
    reply: dict[str, Any] = json.loads(proc.send(line))
    return reply

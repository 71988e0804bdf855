"""A private ``redis-server`` for the fleet's tests: a free loopback port, no persistence.

Never the system service, never a fixed port: each :class:`RedisProc` runs its own
``redis-server`` child on ``127.0.0.1`` and a port that was free a moment ago (a
new one is picked if it was taken meanwhile). Tests may :meth:`~RedisProc.kill`,
:meth:`~RedisProc.pause` (SIGSTOP), :meth:`~RedisProc.resume` (SIGCONT) and
:meth:`~RedisProc.restart` it (same port, empty data). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
from typing import Any

import redis.asyncio as aioredis

START_S = 10.0
"""Upper bound on a start (a failure, not a pace)."""


def redis_server_path() -> str | None:
    """Path of ``redis-server`` (Debian package ``redis-server``), or None."""
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if shutil.which("/usr/bin/redis-server") else None
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class RedisProc:
    """One private ``redis-server``; ``password`` sets ``requirepass``."""

    def __init__(self, password: str | None = None) -> None:
        self.password = password
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.paused = False

    def url(self, password: str | None = None) -> str:
        """``redis://[:password@]127.0.0.1:port/0`` (``password`` defaults to the server's)."""
        pw = self.password if password is None else password
        auth = f":{pw}@" if pw else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> aioredis.Redis:
        """A client for the test itself (decoded strings)."""
        return aioredis.Redis.from_url(self.url(), decode_responses=True, socket_timeout=5)

    async def start(self, *, same_port: bool = False) -> RedisProc:
        """Start on a free port (``same_port``: the current one) and wait for PING."""
        exe = redis_server_path()
        assert exe is not None, "redis-server is not installed (Debian package redis-server)"
        for _ in range(5):
            port = self.port if same_port else free_port()
            args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            args += ["--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
            if self.password:
                args += ["--requirepass", self.password]
            self.proc = await asyncio.create_subprocess_exec(
                *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
            )
            self.port = port
            if await self._ready():
                return self
            await self.kill()
        raise AssertionError("redis-server did not start")

    async def _ready(self) -> bool:
        client = self.client()
        try:
            async with asyncio.timeout(START_S):
                while True:
                    assert self.proc is not None
                    if self.proc.returncode is not None:
                        return False
                    with contextlib.suppress(Exception):
                        # This server's own pid: a port taken between free_port() and the
                        # bind may be answered by another test's Redis.
                        info = await client.info("server")
                        if info.get("process_id") == self.proc.pid:
                            return True
                    await asyncio.sleep(0.02)  # a process starting up: bounded by START_S
        except TimeoutError:
            return False
        finally:
            await client.aclose()

    async def kill(self) -> None:
        """SIGKILL the server (data lost) and reap it."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            if self.paused:
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    async def restart(self) -> None:
        """A fresh, empty server on the same port."""
        await self.start(same_port=True)

    async def dump(self) -> dict[str, Any]:
        """Every key with its value (strings, sorted sets with scores, hashes)."""
        client = self.client()
        out: dict[str, Any] = {}
        try:
            async for key in client.scan_iter(count=1000):
                kind = await client.type(key)
                if kind == "string":
                    out[key] = await client.get(key)
                elif kind == "zset":
                    out[key] = await client.zrange(key, 0, -1, withscores=True)
                elif kind == "hash":
                    out[key] = await client.hgetall(key)
                else:
                    out[key] = kind
        finally:
            await client.aclose()
        return out

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

READY = b"Ready to accept connections"
"""redis-server's log line once it listens (``--loglevel notice``, on its stdout)."""


def redis_server_path() -> str | None:
    """Path of ``redis-server`` (Debian package ``redis-server``), or None."""
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if shutil.which("/usr/bin/redis-server") else None
    )


async def _read_to_end(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


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
        self._log_reader: asyncio.Task[None] | None = None
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
        """Start on a free port (``same_port``: the current one) and wait until it is ready."""
        exe = redis_server_path()
        assert exe is not None, "redis-server is not installed (Debian package redis-server)"
        for _ in range(5):
            port = self.port if same_port else free_port()
            args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            args += ["--appendonly", "no", "--daemonize", "no", "--loglevel", "notice"]
            if self.password:
                args += ["--requirepass", self.password]
            self.proc = await asyncio.create_subprocess_exec(
                *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
            )
            self.port = port
            if await self._ready():
                return self
            await self.kill()
        raise AssertionError("redis-server did not start")

    async def _ready(self) -> bool:
        """Wait (bounded by :data:`START_S`) for this server's own log line saying it
        listens; False when it exited first (its port was taken meanwhile). Its log is
        then read to the end in the background, so the pipe never fills."""
        assert self.proc is not None and self.proc.stdout is not None
        log = self.proc.stdout
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(START_S):
                while line := await log.readline():
                    if READY in line:
                        self._log_reader = asyncio.create_task(_read_to_end(log))
                        return True
                await self.proc.wait()  # its output ended: it exited
        return False

    async def kill(self) -> None:
        """SIGKILL the server (data lost) and reap it."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            if self.paused:
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()
        if self._log_reader is not None:
            await self._log_reader  # ends at the killed server's end of output
            self._log_reader = None
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

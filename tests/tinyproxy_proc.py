"""A private ``tinyproxy`` (Debian package ``tinyproxy``) as the egress proxy of a test.

Never the system service, never a fixed port: each :class:`TinyProxy` runs its own
``tinyproxy -d`` child (in the foreground, logging to its stdout) on 127.0.0.1 and a
port that was free a moment ago, with a config written for it. Its log lines are kept
(:attr:`TinyProxy.lines`): ``Request (file descriptor N): CONNECT host:port HTTP/1.1``
shows a tunnel it was asked for. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from pathlib import Path

from tests.redis_proc import free_port

START_S = 10.0
"""Upper bound on a start (a failure, not a pace)."""

_CONNECT = re.compile(r"Request \(file descriptor \d+\): CONNECT (\S+) HTTP/")

READY = "Accepting connections"
"""tinyproxy's log line once it listens."""


def tinyproxy_path() -> str | None:
    """Path of ``tinyproxy`` (it lives in /usr/bin on Debian), or None."""
    return shutil.which("tinyproxy") or shutil.which("/usr/bin/tinyproxy")


class TinyProxy:
    """One private tinyproxy; ``connect_ports``: the only ports it opens a ``CONNECT``
    tunnel to (tinyproxy's ``ConnectPort``: any other gets 403); None: any port.
    ``basic_auth``: (user, password) it requires (``BasicAuth``: 407 without them)."""

    def __init__(
        self,
        directory: Path,
        connect_ports: list[int] | None = None,
        basic_auth: tuple[str, str] | None = None,
    ) -> None:
        self.directory = directory
        self.connect_ports = connect_ports
        self.basic_auth = basic_auth
        self.port = 0
        self.lines: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._new_line = asyncio.Event()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def _config(self, port: int) -> Path:
        path = self.directory / f"tinyproxy-{port}.conf"
        text = [
            f"Port {port}",
            "Listen 127.0.0.1",
            "Timeout 30",
            "LogLevel Info",  # "Accepting connections", each request line, errors
            "MaxClients 32",
            "Allow 127.0.0.1",
            "DisableViaHeader Yes",
        ]
        text += [f"ConnectPort {p}" for p in self.connect_ports or []]
        if self.basic_auth is not None:
            text.append("BasicAuth {} {}".format(*self.basic_auth))
        path.write_text("\n".join(text) + "\n")
        return path

    async def _read(self, stream: asyncio.StreamReader) -> None:
        try:
            while line := await stream.readline():
                self.lines.append(line.decode(errors="replace").rstrip())
                self._new_line.set()
        finally:
            self._new_line.set()  # the end of its output is news too

    async def start(self) -> TinyProxy:
        """Start on a free port and wait until it accepts connections."""
        exe = tinyproxy_path()
        assert exe is not None, "tinyproxy is not installed (Debian package tinyproxy)"
        for _ in range(5):
            port = free_port()
            self.lines = []
            self.proc = await asyncio.create_subprocess_exec(
                exe,
                "-d",
                "-c",
                str(self._config(port)),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            assert self.proc.stdout is not None
            self._reader = asyncio.create_task(self._read(self.proc.stdout))
            async with asyncio.timeout(START_S):
                while True:
                    self._new_line.clear()  # (before looking: no line is missed)
                    if any(READY in line for line in self.lines) or self._reader.done():
                        break  # ready, or exited (its port was taken meanwhile)
                    await self._new_line.wait()
            if any(READY in line for line in self.lines):
                self.port = port
                return self
            await self.stop()
        raise AssertionError("tinyproxy did not start: " + "\n".join(self.lines[-5:]))

    def connects(self) -> list[str]:
        """The targets of the ``CONNECT`` requests it received (``host:port``)."""
        return [m[1] for line in self.lines if (m := _CONNECT.search(line))]

    async def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 5 s); its port is then closed."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(5):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                self._reader.cancel()
                await self._reader
            self._reader = None

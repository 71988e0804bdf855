"""``python -m sidecar serve`` as a child process on loopback, for tests.

:class:`ServeProc` starts it with a config file, learns its ports from the
``started`` log line, keeps every stdout and stderr line it writes, and stops
it with a signal; :func:`serve_to_exit` runs one that should stop by itself (a
start-up failure). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START_S = 20.0
"""Upper bound on start-up (interpreter, imports, binding)."""


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``SIDECAR*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR")}
    env.update(extra)
    return env


class ServeProc:
    """One ``sidecar serve --config PATH`` child; use ``async with ServeProc.start(...)``."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.proxy_port = 0
        self.admin_port = 0
        self._started = asyncio.Event()
        self._new_line = asyncio.Event()
        assert proc.stdout is not None and proc.stderr is not None
        self._readers = [
            asyncio.create_task(self._collect(proc.stdout, self.stdout, parse=True)),
            asyncio.create_task(self._collect(proc.stderr, self.stderr, parse=False)),
        ]

    @classmethod
    async def start(cls, config: Path, env: Mapping[str, str]) -> ServeProc:
        """Start the child and wait for its ``started`` line.

        :raises AssertionError: it exited first (its output is in the message).
        :raises TimeoutError: not started within :data:`START_S`.
        """
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--config",
            str(config),
            cwd=ROOT,
            env=dict(env),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self = cls(proc)
        try:
            async with asyncio.timeout(START_S):
                waiter = asyncio.create_task(self._started.wait())
                exited = asyncio.create_task(proc.wait())
                await asyncio.wait({waiter, exited}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                exited.cancel()
            assert self._started.is_set(), f"serve exited: {self.stdout} {self.stderr}"
        except BaseException:
            await self.kill()
            raise
        return self

    async def _collect(self, stream: asyncio.StreamReader, into: list[str], *, parse: bool) -> None:
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip("\n")
            into.append(text)
            self._new_line.set()
            self._new_line = asyncio.Event()
            if parse and not self._started.is_set():
                doc = _json(text)
                if doc.get("event") == "started":
                    self.proxy_port = int(doc["proxy_port"])
                    self.admin_port = int(doc["admin_port"])
                    self._started.set()

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def events(self) -> list[dict[str, Any]]:
        """The stdout lines that are JSON objects (the log), in order."""
        return [d for d in map(_json, self.stdout) if d]

    async def wait_for_event(self, name: str, limit_s: float = 10.0) -> dict[str, Any]:
        """Wait until a log line with ``"event": name`` appears; return it.

        :raises TimeoutError: none within ``limit_s`` seconds.
        """
        async with asyncio.timeout(limit_s):
            while True:
                waiter = self._new_line
                for doc in self.events():
                    if doc.get("event") == name:
                        return doc
                await waiter.wait()

    def signal(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    async def wait(self, limit_s: float) -> int:
        """Wait (up to ``limit_s`` seconds) for the exit and all output; return the exit code."""
        async with asyncio.timeout(limit_s):
            code = await self.proc.wait()
            await asyncio.gather(*self._readers)
        return code

    async def kill(self) -> None:
        """Kill the child if it still runs (cleanup after a failure)."""
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        for task in self._readers:
            task.cancel()

    async def __aenter__(self) -> ServeProc:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()


async def serve_to_exit(
    config: Path, env: Mapping[str, str], limit_s: float = START_S
) -> tuple[int, list[str], list[str]]:
    """Run ``sidecar serve --config PATH`` expecting it to exit by itself (a start-up
    failure); return (exit code, stdout lines, stderr lines).

    :raises TimeoutError: still running after ``limit_s`` seconds (it is killed).
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        "serve",
        "--config",
        str(config),
        cwd=ROOT,
        env=dict(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(limit_s):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode().splitlines(), err.decode().splitlines()


def _json(text: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}

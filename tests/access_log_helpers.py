"""Helpers of the access log's end-to-end tests (tests/e2e/test_access_log*.py).

:class:`Lines` collects the lines as the log handler writes them
(:class:`~sidecar.logs.JsonFormatter`); :func:`line` is the expected line of a plain
success, to be overridden field by field.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp

from sidecar.access_log import ACCESS_LOGGER
from sidecar.logs import JsonFormatter

CHAT = "/v1/chat/completions"
KEYS = [
    "ts", "level", "event", "route", "method", "path", "status", "upstream", "attempts",
    "fallbacks", "duration_ms", "first_byte_ms", "outcome", "error",
]  # fmt: skip
WAIT_S = 5.0


class Lines(logging.Handler):
    """Collects the access log's lines as the JSON formatter writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.formatter = JsonFormatter()
        self.text: list[str] = []
        self.changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(self.format(record))
        self.changed.set()

    @property
    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(t) for t in self.text]

    async def wait(self, n: int) -> list[dict[str, Any]]:
        """The first ``n`` lines, once written (the handler ends after the client's read)."""
        async with asyncio.timeout(WAIT_S):
            while len(self.text) < n:
                self.changed.clear()
                await self.changed.wait()
        return self.lines


def capture() -> Iterator[Lines]:
    """For a fixture: collect the access log's lines while the test runs."""
    handler = Lines()
    ACCESS_LOGGER.addHandler(handler)
    yield handler
    ACCESS_LOGGER.removeHandler(handler)


def config(primary: str, backup: str | None = None, *, server: str = "", extra: str = "") -> str:
    text = f"""
[server]
{server}
[upstreams.primary]
base_url = "{primary}"
{extra}
[upstreams.primary.retry]
max_retries = 1
backoff_initial_ms = 10
backoff_max_ms = 10
"""
    cands = '{ upstream = "primary" }'
    if backup is not None:
        text += f'[upstreams.backup]\nbase_url = "{backup}"\n[upstreams.backup.retry]\n'
        text += "max_retries = 0\n"
        cands += ', { upstream = "backup" }'
    text += f"""
[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{cands}]
[[routes]]
name = "strict"
path_prefix = "/strict/"
models = ["gpt-4o"]
candidates = [{{ upstream = "primary" }}]
"""
    return text


def line(**fields: Any) -> dict[str, Any]:
    """The expected line: a plain success on ``chat`` unless ``fields`` say otherwise."""
    base: dict[str, Any] = {
        "level": "info", "event": "request", "route": "chat", "method": "POST", "path": CHAT,
        "status": 200, "upstream": "primary", "attempts": 1, "fallbacks": 0,
        "duration_ms": 0.0, "first_byte_ms": 0.0, "outcome": "ok", "error": None,
    }  # fmt: skip
    return base | fields


def without_ts(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for got in lines:
        assert list(got) == KEYS
    return [{k: v for k, v in got.items() if k != "ts"} for got in lines]


async def post(http: aiohttp.ClientSession, url: str, **kwargs: Any) -> int:
    if "data" not in kwargs:
        kwargs.setdefault("json", {"model": "gpt-4o"})
    async with http.post(url, **kwargs) as r:
        await r.read()
        return r.status

"""Helpers of the access log's end-to-end tests (tests/e2e/test_access_log*.py).

:class:`Lines` collects the lines as the log handler writes them
(:class:`~sidecar.logs.JsonFormatter`); :func:`line` is the expected line of a plain
success, to be overridden field by field.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp

from sidecar.access_log import ACCESS_LOGGER
from sidecar.logs import JsonFormatter
from tests.configs import config, route, upstream

CHAT = "/v1/chat/completions"
KEYS = [
    "ts", "level", "event", "route", "method", "path", "status", "upstream", "attempts",
    "fallbacks", "duration_ms", "first_byte_ms", "outcome", "error", "upstream_error",
    "input_tokens", "output_tokens", "cache_read_tokens",
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


def access_config(
    primary: str,
    backup: str | None = None,
    *,
    server: Mapping[str, Any] | None = None,
    **primary_keys: Any,
) -> str:
    """``primary`` (1 retry, 10 ms backoff, ``primary_keys`` such as
    ``first_byte_timeout_ms`` or ``circuit_breaker``), ``backup`` (no retries) when
    given; route ``chat`` over both on ``/v1/`` and route ``strict`` (model ``gpt-4o``)
    over ``primary`` on ``/strict/``. Built by :mod:`tests.configs`."""
    # No jitter: the 10 ms wait shows in the lines' durations as it is.
    retry = {"max_retries": 1, "backoff_initial_ms": 10, "backoff_max_ms": 10, "jitter": False}
    upstreams = {"primary": upstream(primary, retry=retry, **primary_keys)}
    chat = ["primary"]
    if backup is not None:
        upstreams["backup"] = upstream(backup, retry={"max_retries": 0})
        chat.append("backup")
    return config(
        server=server or {},
        upstreams=upstreams,
        routes=[
            route("chat", *chat, path_prefix="/v1/"),
            route("strict", "primary", path_prefix="/strict/", models=["gpt-4o"]),
        ],
    )


def line(**fields: Any) -> dict[str, Any]:
    """The expected line: a plain success on ``chat`` unless ``fields`` say otherwise."""
    base: dict[str, Any] = {
        "level": "info", "event": "request", "route": "chat", "method": "POST", "path": CHAT,
        "status": 200, "upstream": "primary", "attempts": 1, "fallbacks": 0,
        "duration_ms": 0.0, "first_byte_ms": 0.0, "outcome": "ok", "error": None,
        "upstream_error": None,
        "input_tokens": None, "output_tokens": None, "cache_read_tokens": None,
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

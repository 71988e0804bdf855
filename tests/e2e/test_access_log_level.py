"""The access log is written whatever ``log_level`` is, through the real stdout setup.

``sidecar serve`` calls :func:`sidecar.logs.setup` with ``log_level``; here it is
called the same way (stdout captured by pytest), the sidecar runs in-process, and
the captured stdout must hold one ``request`` line per request and nothing at INFO
besides (``started`` is not there at ``error``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from sidecar import logs
from sidecar.testing import FakeUpstream
from tests.configs import single
from tests.conftest import StartSidecar


@pytest.fixture
def stdout_logging() -> Iterator[None]:
    """Undo :func:`sidecar.logs.setup` after the test (pytest's own handlers come back)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    aiohttp_level = logging.getLogger("aiohttp.access").level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(aiohttp_level)


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("level", ["error", "warning", "debug"])
async def test_one_line_per_request_at_every_log_level(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    capsys: pytest.CaptureFixture[str],
    stdout_logging: None,
    level: str,
) -> None:
    logs.setup(level)
    sc = await start_sidecar(single(fake.url, server={"log_level": level}))
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/chat/completions", "/nowhere", "/v1/models"):
            async with http.post(sc.proxy_url + path, json={"model": "m"}) as r:
                await r.read()
        # The handler's end may follow the client's read: a last request on the same
        # connection starts only after the previous handler ended.
        async with http.get(sc.proxy_url + "/v1/models") as r:
            await r.read()
    await asyncio.sleep(0)
    assert logs.STDOUT_HANDLER is not None
    logs.STDOUT_HANDLER.flush()  # access lines are batched (sidecar.logs.LINES_FLUSH_S)
    lines = json_lines(capsys.readouterr().out)
    requests = [d for d in lines if d["event"] == "request"]
    assert [(d["path"], d["status"], d["level"]) for d in requests][:3] == [
        ("/v1/chat/completions", 200, "info"),
        ("/nowhere", 404, "info"),
        ("/v1/models", 200, "info"),
    ]
    assert any(d["event"] == "started" for d in lines) == (level == "debug")

"""The access log's lines reach stdout in batches, not in one ``write`` per request.

At concurrency 1 a closed-loop client sends its next request as soon as it has its
answer; a ``write`` to stdout after every answer (``benchmarks/results/latency-c1.md``:
the sidecar's only system call per request that the bare aiohttp relay does not make)
sat on that serial path. The stdout handler of ``sidecar serve`` now holds the lines
and writes them together, within ``sidecar.logs.LINES_FLUSH_S``, and before any other
line, so stdout's order is kept. Observed here on a stream that records each write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from sidecar import logs
from sidecar.testing import FakeUpstream
from tests.configs import single
from tests.conftest import StartSidecar

WAIT_S = 5.0


class Stdout:
    """A text stream that keeps every ``write`` call apart."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.written = asyncio.Event()

    def write(self, text: str) -> int:
        self.writes.append(text)
        self.written.set()
        return len(text)

    def flush(self) -> None:
        pass

    def events(self, write: str) -> list[str]:
        return [orjson.loads(line)["event"] for line in write.splitlines()]


def use(stdout: Stdout, monkeypatch: pytest.MonkeyPatch) -> None:
    """``logs.setup()`` (as ``sidecar serve`` calls it) writing to ``stdout``."""
    monkeypatch.setattr("sys.stdout", stdout)
    logs.setup("warning")


@pytest.fixture
def stdout(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stdout]:
    """A :class:`Stdout`, and the root logger's handlers back after the test.

    The test calls :func:`use` itself: pytest sets its own ``sys.stdout`` and adds its
    own handlers to the root logger after the fixtures ran (with another handler
    listening, the access line takes the record path, written at once)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr(logs, "STDOUT_HANDLER", None)
    yield Stdout()
    if logs.STDOUT_HANDLER is not None:
        monkeypatch.setattr(
            logs.STDOUT_HANDLER, "_pending", [], raising=False
        )  # nothing left for a timer
    root.handlers[:] = handlers
    root.setLevel(level)


async def test_requests_in_a_row_make_one_write(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    stdout: Stdout,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logs, "LINES_FLUSH_S", 3600.0, raising=False)  # only the flush below writes
    use(stdout, monkeypatch)
    sc = await start_sidecar(single(fake.url))
    paths = [f"/v1/chat/completions?n={i}" for i in range(20)]
    connector = aiohttp.TCPConnector(limit=1)  # one connection: each handler ends first
    async with aiohttp.ClientSession(connector=connector) as http, asyncio.timeout(WAIT_S):
        for path in paths:
            async with http.post(sc.proxy_url + path, json={"model": "m"}) as r:
                assert r.status == 200
                await r.read()
        async with http.get(sc.proxy_url + "/v1/models") as r:  # after the 20th's end
            await r.read()
    assert stdout.writes == []  # before: one write per request, 20 of them by now
    handler = logs.STDOUT_HANDLER
    assert handler is not None
    handler.flush()
    assert len(stdout.writes) == 1
    lines = [orjson.loads(x) for x in stdout.writes[0].splitlines()]
    assert [d["event"] for d in lines][:20] == ["request"] * 20
    assert [d["status"] for d in lines][:20] == [200] * 20


async def test_a_held_line_is_written_within_the_interval(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    stdout: Stdout,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logs, "LINES_FLUSH_S", 0.0, raising=False)  # the loop's next turn
    use(stdout, monkeypatch)
    sc = await start_sidecar(single(fake.url))
    async with aiohttp.ClientSession() as http, asyncio.timeout(WAIT_S):
        async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
            await r.read()
        while not any("request" in stdout.events(w) for w in stdout.writes):
            stdout.written.clear()
            await stdout.written.wait()  # no flush called: the handler's timer writes


async def test_another_line_goes_out_after_the_held_ones(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    stdout: Stdout,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logs, "LINES_FLUSH_S", 3600.0, raising=False)
    use(stdout, monkeypatch)
    sc = await start_sidecar(single(fake.url))
    async with aiohttp.ClientSession() as http, asyncio.timeout(WAIT_S):
        for _ in range(2):
            async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
                await r.read()
        async with http.get(sc.proxy_url + "/v1/models") as r:
            await r.read()
    logs.event("elsewhere", level=logging.WARNING)  # a record: held lines first
    *_, held, last = [stdout.events(w) for w in stdout.writes]
    assert last == ["elsewhere"]
    assert held in (["request"] * 2, ["request"] * 3)  # the GET's line, if its handler ended

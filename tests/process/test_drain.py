"""Drain on SIGTERM, black-box: a real ``sidecar serve`` child with 100 live streams through it.

Contract, "Shutdown": ``/readyz`` turns 503 at once, new connections are refused,
in-flight streams may finish within ``drain_timeout_ms``, the rest are aborted
(the client sees a payload error, never a clean end), upstream connections are
closed, exit 0.

Which streams finish is decided by two :class:`asyncio.Event` gates in the
in-process fake upstream: half the streams stall after their first event on
gate A, released right after SIGTERM; the other half on gate B, held until
the sidecar has exited (past ``drain_timeout_ms`` = 1000).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp

from sidecar.testing import FakeUpstream, Fault
from tests.configs import single
from tests.serve_proc import ServeProc, child_env

STREAMS = 100
DRAIN_MS = 1000
WAIT_S = 10.0
CHUNKS = 5
CHUNK_GAP_MS = 60
FULL_TEXT = "Hello from the fake upstream"  # DEFAULT_WORDS[0:5]


def sse_text(body: bytes) -> tuple[str, bool]:
    """(the concatenated delta text, whether the stream ended with ``[DONE]``)."""
    text, done = "", False
    for block in body.decode().split("\n\n"):
        if not block:
            continue
        data = block.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        for choice in json.loads(data)["choices"]:
            text += choice["delta"].get("content") or ""
    return text, done


class Stream:
    """One client stream: its fake request index, bytes received, and how it ended."""

    def __init__(self) -> None:
        self.index = 0
        self.body = b""
        self.error: BaseException | None = None


async def run_stream(
    http: aiohttp.ClientSession,
    url: str,
    s: Stream,
    started: list[Stream],
    all_started: asyncio.Event,
) -> None:
    async with http.post(url, json={"model": "gpt-4o", "stream": True}) as r:
        assert r.status == 200
        s.index = int(r.headers["x-fake-request"])
        s.body = await r.content.readany()
        started.append(s)
        if len(started) == STREAMS:
            all_started.set()
        try:
            s.body += await r.content.read()
        except aiohttp.ClientPayloadError as exc:
            s.error = exc


async def test_sigterm_drains_streams_within_deadline_and_aborts_the_rest(
    tmp_path: Path, fake: FakeUpstream
) -> None:
    gate_a, gate_b = asyncio.Event(), asyncio.Event()
    # Gate A streams are still producing events for a while after their release
    # (an LLM streaming tokens): they finish well inside the drain period, not at once.
    fake.script(
        [Fault(chunks=CHUNKS, chunk_delay_ms=CHUNK_GAP_MS, hold_after_chunks=(2, gate_a))]
        * (STREAMS // 2)
        + [Fault(chunks=CHUNKS, hold_after_chunks=(2, gate_b))] * (STREAMS // 2)
    )
    path = tmp_path / "sidecar.toml"
    path.write_text(
        single(
            fake.url,
            server={
                "listen": "127.0.0.1:0",
                "admin_listen": "127.0.0.1:0",
                "drain_timeout_ms": DRAIN_MS,
            },
        )
    )
    loop = asyncio.get_running_loop()
    async with (
        await ServeProc.start(path, child_env()) as sc,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
        aiohttp.ClientSession() as admin,
    ):
        async with admin.get(sc.admin_url + "/readyz") as r:
            assert r.status == 200

        streams = [Stream() for _ in range(STREAMS)]
        started: list[Stream] = []
        all_started = asyncio.Event()
        url = sc.proxy_url + "/v1/chat/completions"
        tasks = [
            asyncio.create_task(run_stream(http, url, s, started, all_started)) for s in streams
        ]
        async with asyncio.timeout(WAIT_S):
            await all_started.wait()
        assert fake.active_requests == STREAMS

        sc.signal()
        sigterm_at = loop.time()

        # /readyz turns 503 at once (well before the drain deadline).
        async with asyncio.timeout(DRAIN_MS / 1000 / 2):
            while True:
                async with admin.get(sc.admin_url + "/readyz") as r:
                    if r.status == 503:
                        break
                    assert r.status == 200
        # The listener is closed: a new connection is refused.
        async with asyncio.timeout(DRAIN_MS / 1000 / 2):
            while True:
                try:
                    _, w = await asyncio.open_connection("127.0.0.1", sc.proxy_port)
                except ConnectionRefusedError:
                    break
                w.close()
                await asyncio.sleep(0)
        assert not any(t.done() for t in tasks), "a stream ended before its gate opened"

        gate_a.set()  # half the streams may now finish within the drain period
        async with asyncio.timeout(WAIT_S):
            code = await sc.wait(WAIT_S)
            await asyncio.gather(*tasks)
        exited_after = loop.time() - sigterm_at
        gate_b.set()

    assert code == 0
    # It waited for the drain period (gate B streams were still open), then stopped at
    # once: not after twice the period, as aiohttp's own two-phase shutdown would.
    assert DRAIN_MS / 1000 * 0.9 <= exited_after < DRAIN_MS / 1000 * 1.75
    by_gate = {
        id(gate_a): [
            s for s in streams if fake.requests[s.index - 1].fault.hold_after_chunks == (2, gate_a)
        ],
        id(gate_b): [
            s for s in streams if fake.requests[s.index - 1].fault.hold_after_chunks == (2, gate_b)
        ],
    }
    finished, aborted = by_gate[id(gate_a)], by_gate[id(gate_b)]
    assert len(finished) == len(aborted) == STREAMS // 2
    for s in finished:
        assert s.error is None
        assert sse_text(s.body) == (FULL_TEXT, True)
    for s in aborted:
        assert isinstance(s.error, aiohttp.ClientPayloadError)
        assert b"[DONE]" not in s.body
    # Upstream connections were closed on the way out.
    async with asyncio.timeout(WAIT_S):
        await fake.wait_until(lambda: fake.open_connections == 0)
    events = [e["event"] for e in sc.events()]
    assert "draining" in events and events[-1] == "stopped"

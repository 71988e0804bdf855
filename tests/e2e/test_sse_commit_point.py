"""Issue 12, items 1 and 2: a streamed answer commits at its first output event.

Through the running sidecar, with the fake upstream's byte-exact provider shapes
(``sidecar.testing.error_shapes``). The bytes the client must get are rendered
again from the fake's own record of the request (``render``), so every comparison
is byte for byte. Time moves only by ``clock.advance``; holds are Event gates.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from types import MappingProxyType, SimpleNamespace
from typing import Any

import aiohttp
import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeClock, FakeUpstream, Fault, error_shapes, shapes
from sidecar.testing.render import render
from tests.breaker_e2e_helpers import SERVER_TABLE, breaker_table, chain_upstream, entry
from tests.configs import config, route
from tests.conftest import StartSidecar, metric

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
WAIT_S = 5.0
KA = error_shapes.KEEPALIVE
FIRST_BYTE_1S = {"first_byte_timeout_ms": 1000, "idle_timeout_ms": 60000}
NO_KEYS: Mapping[str, Any] = MappingProxyType({})


@pytest.fixture(autouse=True)
def fixed_created(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake's bodies carry ``created`` (unix seconds): fixed here, so a body rendered
    again by :func:`sent_by` equals the one sent even across a second's boundary."""
    monkeypatch.setattr(shapes, "time", SimpleNamespace(time=lambda: 1_700_000_000.0))


def sent_by(fake: FakeUpstream, index: int = -1) -> list[bytes]:
    """The body chunks the fake sent for its request ``index`` (rendered again)."""
    rec = fake.requests[index]
    return render(rec, json.loads(rec.body), fake.models).chunks


async def chain(
    start_sidecar: StartSidecar,
    primary: str,
    backup: str | None = None,
    *,
    retries: int = 0,
    cb: Mapping[str, Any] = breaker_table(threshold=2),
    primary_keys: Mapping[str, Any] = NO_KEYS,
) -> Sidecar:
    """Route "chat": ``primary`` (breaker ``cb``), then ``backup`` (no breaker) if given."""
    upstreams = {"primary": chain_upstream(primary, breaker=cb, retries=retries, **primary_keys)}
    if backup is not None:
        upstreams["backup"] = chain_upstream(backup, breaker=None)
    text = config(
        server=SERVER_TABLE,
        upstreams=upstreams,
        routes=[route("chat", *upstreams, path_prefix="/v1/")],
    )
    return await start_sidecar(text)


async def post(
    http: aiohttp.ClientSession, sc: Sidecar, path: str = CHAT
) -> tuple[int, dict[str, str], bytes]:
    doc = {"model": "m", "stream": True, "messages": []}
    async with asyncio.timeout(WAIT_S):
        async with http.post(sc.proxy_url + path, json=doc) as r:
            return r.status, dict(r.headers), await r.read()


async def raw_chunks(port: int, path: str) -> tuple[bytes, list[bytes]]:
    """POST a streamed request on a raw socket: (the head, each HTTP chunk's data)."""
    body = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        async with asyncio.timeout(WAIT_S):
            head = await reader.readuntil(b"\r\n\r\n")
            assert b"transfer-encoding: chunked" in head.lower(), head
            chunks: list[bytes] = []
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
        return head, chunks
    finally:
        writer.close()


# -- 1. events without output are held; the first output event commits ------------------


@pytest.mark.parametrize(("path", "held"), [(CHAT, 1), (MESSAGES, 2)])
async def test_held_events_go_out_with_the_first_output_event_in_one_write(
    fake: FakeUpstream, start_sidecar: StartSidecar, path: str, held: int
) -> None:
    """Keep-alive comments and the role-only chunk (OpenAI) or ``message_start`` and
    ``content_block_start`` (Anthropic) are held; the first content event commits, and
    the client's first HTTP chunk is every held byte and that event: one write."""
    sc = await chain(start_sidecar, fake.url)
    fake.set_default(Fault(keepalives=2))
    head, chunks = await raw_chunks(sc.proxy_port, path)
    assert head.startswith(b"HTTP/1.1 200")
    sent = sent_by(fake)
    committing = 2 + held + 1  # keep-alives, output-free events, the first output event
    assert sent[:2] == [KA, KA]
    assert chunks[0][: len(b"".join(sent[:committing]))] == b"".join(sent[:committing])
    assert b"".join(chunks) == b"".join(sent)  # byte-identical overall


async def test_first_byte_timeout_runs_to_the_first_output_event(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
) -> None:
    """Keep-alives and a role-only chunk arrive, then nothing: the first-byte timeout
    fires, the next candidate answers, and the client gets only its bytes."""
    sc = await chain(
        start_sidecar,
        fake.url,
        fake2.url,
        cb=breaker_table(threshold=1),
        primary_keys=FIRST_BYTE_1S,
    )
    gate = asyncio.Event()
    fake.set_default(Fault(keepalives=3, hold_after_chunks=(4, gate)))
    task = asyncio.ensure_future(post(http, sc))
    async with asyncio.timeout(WAIT_S):
        await fake.wait_for_requests(1)
    clock.advance(1.0)
    code, headers, body = await task
    gate.set()
    assert (code, headers["x-sidecar-upstream"]) == (200, "backup")
    assert body == b"".join(sent_by(fake2))
    e = await entry(http, sc)
    assert (e["state"], e["last_failure"]) == ("open", "timeout")


async def test_more_than_64_kib_held_commits_and_stops_the_first_byte_timer(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession, clock: FakeClock
) -> None:
    sc = await chain(start_sidecar, fake.url, primary_keys=FIRST_BYTE_1S)
    gate = asyncio.Event()
    n = 64 * 1024 // len(KA) + 10  # a little more than 64 KiB of keep-alives
    fake.set_default(Fault(keepalives=n, hold_after_chunks=(n, gate)))
    doc = {"model": "m", "stream": True, "messages": []}
    async with asyncio.timeout(WAIT_S), http.post(sc.proxy_url + CHAT, json=doc) as r:
        assert r.status == 200  # committed at the limit while the fake still holds
        assert await r.content.readexactly(n * len(KA)) == KA * n
        clock.advance(5.0)  # past first_byte_timeout_ms: that timer stopped at the commit
        gate.set()
        rest = await r.read()
    assert KA * n + rest == b"".join(sent_by(fake))
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_end_of_stream_commits_with_what_is_held(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    events = KA + error_shapes.anthropic_stream_head("m", "msg_1") + error_shapes.anthropic_ping()
    fake.set_default(Fault(body=events, chunks=3, content_type="text/event-stream"))
    sc = await chain(start_sidecar, fake.url)
    code, headers, body = await post(http, sc, MESSAGES)
    assert (code, headers["x-sidecar-upstream"], body) == (200, "primary", events)


# -- 2. error events before any output ---------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "path"), [("anthropic_overloaded", MESSAGES), ("openai_server_error", CHAT)]
)
async def test_provider_error_event_is_retried_counted_once_then_falls_back(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    shape: str,
    path: str,
) -> None:
    sc = await chain(start_sidecar, fake.url, fake2.url, retries=1)
    fake.set_default(Fault(shape=shape, keepalives=1))
    attempts = "sidecar_upstream_attempts_total"
    before = await metric(http, sc, attempts, upstream="primary", outcome="sse_error")
    code, headers, body = await post(http, sc, path)
    assert (code, headers["x-sidecar-upstream"], headers["x-sidecar-attempts"]) == (
        200,
        "backup",
        "3",
    )
    assert body == b"".join(sent_by(fake2))  # none of the failed streams' bytes
    assert fake.request_count == 2  # 1 + max_retries
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"], e["last_failure"]) == (
        "closed",
        1,
        "sse_error",
    )
    assert await metric(http, sc, attempts, upstream="primary", outcome="sse_error") == before + 2
    # A second call: the second failure opens the breaker (threshold 2), counted once more.
    await post(http, sc, path)
    assert (await entry(http, sc))["state"] == "open"


@pytest.mark.parametrize(
    ("shape", "path"), [("anthropic_invalid_request", MESSAGES), ("openai_invalid_request", CHAT)]
)
async def test_caller_error_event_is_relayed_as_it_came_and_neutral(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    shape: str,
    path: str,
) -> None:
    sc = await chain(start_sidecar, fake.url, fake2.url, retries=2, cb=breaker_table(threshold=1))
    fake.set_default(Fault(shape=shape))
    code, headers, body = await post(http, sc, path)
    assert (code, headers["x-sidecar-upstream"]) == (200, "primary")
    assert body == b"".join(sent_by(fake))
    assert (fake.request_count, fake2.request_count) == (1, 0)
    e = await entry(http, sc)
    assert (e["state"], e["consecutive_failures"]) == ("closed", 0)


async def test_last_candidates_failed_stream_is_relayed_as_it_came(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await chain(start_sidecar, fake.url, retries=1)
    fake.set_default(Fault(shape="anthropic_overloaded", keepalives=2))
    code, headers, body = await post(http, sc, MESSAGES)
    assert (code, headers["x-sidecar-attempts"]) == (200, "2")
    assert body == b"".join(sent_by(fake))  # the last attempt's stream, byte for byte
    assert b"overloaded_error" in body and "x-should-retry" not in headers
    assert (await entry(http, sc))["last_failure"] == "sse_error"

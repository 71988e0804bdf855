"""Tests of the fault-injecting fake upstream (sidecar.testing)."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import signal
import sys
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from sidecar.testing import FakeUpstream, Fault, closed_port, fault_from_json, saturated_listener

CHAT = "/v1/chat/completions"
HELLO = "Hello from the fake upstream"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as f:
        yield f


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        yield s


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event in ``raw``."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields.get("event"), fields["data"]))
    return out


async def post(
    session: aiohttp.ClientSession, fake: FakeUpstream, path: str = CHAT, **body: Any
) -> tuple[int, CIMultiDictProxy[str], bytes]:
    async with session.post(fake.url + path, json={"model": "gpt-4o", **body}) as r:
        return r.status, r.headers, await r.read()


# -- shapes ---------------------------------------------------------------------


async def test_chat_completion_json_echoes_model(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    status, headers, body = await post(session, fake, model="my-model")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert int(headers["Content-Length"]) == len(body)
    c = ChatCompletion.model_validate_json(body)
    assert c.object == "chat.completion"
    assert c.model == "my-model"
    assert c.choices[0].message.content == HELLO
    assert c.choices[0].finish_reason == "stop"
    assert c.usage is not None and c.usage.completion_tokens == 5


async def test_chat_stream_chunks_validate(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    fake.set_default(Fault(chunks=3, text="abcdef"))
    status, headers, body = await post(session, fake, stream=True)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert "Content-Length" not in headers
    events = sse_events(body)
    assert events[-1] == (None, "[DONE]")
    chunks = [ChatCompletionChunk.model_validate_json(d) for _, d in events[:-1]]
    assert len(chunks) == 3 + 2
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "abcdef"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert {c.model for c in chunks} == {"gpt-4o"}


async def test_openai_sdk_chat_stream_and_non_stream(fake: FakeUpstream) -> None:
    client = openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0)
    try:
        msgs: Any = [{"role": "user", "content": "hi"}]
        c = await client.chat.completions.create(model="gpt-4o", messages=msgs)
        assert c.choices[0].message.content == HELLO
        assert c.model == "gpt-4o"
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=msgs, stream=True, stream_options={"include_usage": True}
        )
        text, usage = "", None
        async for chunk in stream:
            assert chunk.model == "gpt-4o-mini"
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text == HELLO
        assert usage is not None and usage.total_tokens == 15
        assert fake.requests[1].headers["Authorization"] == "Bearer x"
    finally:
        await client.close()


async def test_openai_sdk_embeddings_models_responses(fake: FakeUpstream) -> None:
    client = openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0)
    try:
        e = await client.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
        assert [d.index for d in e.data] == [0, 1]
        assert len(e.data[0].embedding) == 8  # the SDK asked for base64 and decoded it
        assert fake.requests[-1].json()["encoding_format"] == "base64"
        models = [m.id async for m in client.models.list()]
        assert "gpt-4o" in models
        r = await client.responses.create(model="gpt-4o", input="hi")
        assert r.output_text == HELLO
        assert r.model == "gpt-4o"
        deltas = []
        async with client.responses.stream(model="gpt-4o", input="hi") as s:
            async for ev in s:
                if ev.type == "response.output_text.delta":
                    deltas.append(ev.delta)
            final = await s.get_final_response()
        assert "".join(deltas) == HELLO == final.output_text
    finally:
        await client.close()


async def test_embeddings_float_and_response_shapes(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    _, _, body = await post(session, fake, "/v1/embeddings", input="x", encoding_format="float")
    emb = CreateEmbeddingResponse.model_validate_json(body)
    assert len(emb.data) == 1 and emb.model == "gpt-4o"
    _, _, body = await post(session, fake, "/v1/responses", input="x")
    assert Response.model_validate_json(body).output_text == HELLO


async def test_anthropic_message_and_stream_order(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    m = "claude-sonnet-4-5"
    _, _, body = await post(session, fake, "/v1/messages", model=m, max_tokens=5)
    msg = json.loads(body)
    assert msg["type"] == "message" and msg["model"] == m
    assert msg["content"] == [{"type": "text", "text": HELLO}]
    assert msg["stop_reason"] == "end_turn"
    fake.set_default(Fault(chunks=2))
    _, headers, body = await post(session, fake, "/v1/messages", model=m, stream=True)
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(body)
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    datas = [json.loads(d) for _, d in events]
    assert [d["type"] for d in datas] == names
    assert datas[0]["message"]["model"] == m
    assert "".join(d["delta"]["text"] for d in datas[2:4]) == "Hello from"


async def test_anthropic_sdk_models_and_messages(fake: FakeUpstream) -> None:
    client = anthropic.AsyncAnthropic(base_url=fake.url, api_key="x", max_retries=0)
    try:
        page = await client.models.list()
        assert [m.id for m in page.data] == list(fake.models)
        assert page.has_more is False and page.last_id == fake.models[-1]
        msg = await client.messages.create(
            model="claude-fake-1", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
        assert msg.content[0].type == "text" and msg.content[0].text == HELLO
    finally:
        await client.close()


async def test_status_retry_after_and_error_shapes(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    fake.set_default(Fault(status=503, retry_after="7", headers={"x-extra": "1"}))
    status, headers, body = await post(session, fake, stream=True)
    assert (status, headers["Retry-After"], headers["x-extra"]) == (503, "7", "1")
    assert json.loads(body)["error"]["type"] == "server_error"
    status, headers, body = await post(session, fake, "/v1/messages")
    assert status == 503
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "fake upstream: status 503"},
    }
    fake.set_default(Fault(status=429))
    client = openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="m", messages=[])
    finally:
        await client.close()


async def test_echo_route(fake: FakeUpstream, session: aiohttp.ClientSession) -> None:
    headers = CIMultiDict([("X-Dup", "a"), ("X-Dup", "b")])
    async with session.put(fake.url + "/echo/x?q=1", data=b"\xffraw", headers=headers) as r:
        doc = await r.json()
    assert doc["method"] == "PUT" and doc["path"] == "/echo/x" and doc["query_string"] == "q=1"
    assert ["X-Dup", "a"] in doc["headers"] and ["X-Dup", "b"] in doc["headers"]
    assert doc["body_base64"] == "/3Jhdw=="
    rec = fake.requests[0]
    assert rec.headers.getall("x-dup") == ["a", "b"]
    assert (rec.body, rec.model, rec.connection, rec.index) == (b"\xffraw", None, 1, 1)


# -- body variants ----------------------------------------------------------------


async def test_gzip_bytes_pass_as_is(fake: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake.set_default(Fault(gzip=True))
    _, headers, body = await post(session, fake)
    assert headers["Content-Encoding"] == "gzip"
    assert body[:2] == b"\x1f\x8b" and int(headers["Content-Length"]) == len(body)
    assert ChatCompletion.model_validate_json(gzip.decompress(body)).model == "gpt-4o"
    async with session.post(fake.url + CHAT, json={"model": "m", "stream": True}) as r:
        d = zlib.decompressobj(wbits=31)
        first = d.decompress(await r.content.readany())  # sync-flushed: decodable at once
        assert first.startswith(b"data: {")
        rest = d.decompress(await r.read()) + d.flush()
    assert (first + rest).endswith(b"data: [DONE]\n\n")


async def test_empty_body_raw_body_and_content_type(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    fake.script(
        [
            Fault(empty_body=True),
            Fault(body=b"data: broken\n\n", content_type="text/event-stream", chunks=2),
        ]
    )
    status, headers, body = await post(session, fake, stream=True)
    assert (status, headers["Content-Length"], body) == (200, "0", b"")
    status, headers, body = await post(session, fake)
    assert (headers["Content-Type"], body) == ("text/event-stream", b"data: broken\n\n")


# -- resets ----------------------------------------------------------------------


async def test_reset_before_headers(
    fake: FakeUpstream, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake.script([Fault(reset_before_headers=True)])
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await post(session, fake)
    await fake.wait_until(lambda: fake.active_requests == 0 and fake.open_connections == 0)
    assert fake.request_count == 1
    assert (await post(session, fake))[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_reset_after_headers(
    fake: FakeUpstream, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake.script([Fault(reset_after_headers=True), Fault(reset_after_headers=True)])
    for stream in (True, False):
        async with session.post(fake.url + CHAT, json={"model": "m", "stream": stream}) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
    await fake.wait_until(lambda: fake.active_requests == 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_reset_after_chunks_mid_stream(
    fake: FakeUpstream, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake.script([Fault(reset_after_chunks=2), Fault(reset_after_chunks=1, chunks=4)])
    async with session.post(fake.url + CHAT, json={"model": "m", "stream": True}) as r:
        lines = [await r.content.readline() for _ in range(4)]
        assert lines[0].startswith(b"data: {") and lines[2].startswith(b"data: {")
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.content.readline()
    async with session.post(fake.url + CHAT, json={"model": "m"}) as r:  # Content-Length body
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    await fake.wait_until(lambda: fake.active_requests == 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_reset_after_chunks_flushes_sent_bytes_first(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    size = 8 * 1024 * 1024  # far more than the socket buffers: asyncio must buffer it
    fake.script([Fault(body=b"x" * size, chunks=2, reset_after_chunks=1)])
    received = 0
    async with session.post(fake.url + CHAT, json={}) as r:
        assert r.content_length == size
        with pytest.raises(aiohttp.ClientPayloadError):
            while chunk := await r.content.readany():
                received += len(chunk)
    assert received == size // 2


# -- gates, stalls and delays ----------------------------------------------------------


async def test_hold_headers_gate(fake: FakeUpstream, session: aiohttp.ClientSession) -> None:
    gate = asyncio.Event()
    fake.script([Fault(hold_headers=gate)])
    task = asyncio.create_task(post(session, fake))
    await fake.wait_for_requests(1)
    assert not task.done()
    gate.set()
    assert (await task)[0] == 200


async def test_hold_first_chunk_and_after_chunks(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    first, later = asyncio.Event(), asyncio.Event()
    fake.script([Fault(hold_first_chunk=first, hold_after_chunks=(2, later))])
    async with session.post(fake.url + CHAT, json={"model": "m", "stream": True}) as r:
        assert r.status == 200  # headers came while the body is held
        reader = asyncio.create_task(r.content.readline())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not reader.done()
        first.set()
        assert (await reader).startswith(b"data: {")
        assert [await r.content.readline() for _ in range(3)][1].startswith(b"data: {")
        reader = asyncio.create_task(r.content.readline())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not reader.done()
        later.set()
        rest = await reader + await r.read()
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_stall_released(fake: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake.script([Fault(stall=True), Fault(stall_after_chunks=1, chunks=2)])
    async with session.post(fake.url + CHAT, json={"model": "m"}) as r:
        reader = asyncio.create_task(r.read())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not reader.done()
        fake.release()
        assert ChatCompletion.model_validate_json(await reader).model == "m"
    async with session.post(fake.url + CHAT, json={"model": "m"}) as r:
        part = await r.content.readany()
        assert part and b"chat.completion" in part
        fake.release()
        ChatCompletion.model_validate_json(part + await r.read())


async def test_close_ends_stalled_response(session: aiohttp.ClientSession) -> None:
    fake = await FakeUpstream(default=Fault(stall=True)).start()
    async with session.post(fake.url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200
        await fake.close()
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    assert (fake.active_requests, fake.open_connections) == (0, 0)


async def test_client_disconnect_ends_stalled_handler(fake: FakeUpstream) -> None:
    fake.set_default(Fault(stall=True))
    async with aiohttp.ClientSession() as s, s.post(fake.url + CHAT, json={}) as r:
        assert r.status == 200
        assert fake.active_requests == 1
    await fake.wait_until(lambda: fake.active_requests == 0 and fake.open_connections == 0)


async def test_wall_clock_delays(fake: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake.set_default(
        Fault(delay_headers_ms=20, delay_first_chunk_ms=20, chunk_delay_ms=10, chunks=3)
    )
    start = time.monotonic()
    await post(session, fake, stream=True)  # 3 content chunks + 3 framing events = 6 writes
    assert time.monotonic() - start >= 0.020 + 0.020 + 5 * 0.010


# -- selection of faults --------------------------------------------------------------


async def test_script_fifo_then_default(fake: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake.script([Fault(status=503), Fault(status=429)])
    fake.set_default(Fault(status=201))
    assert [(await post(session, fake))[0] for _ in range(4)] == [503, 429, 201, 201]
    assert [r.fault.status for r in fake.requests] == [503, 429, 201, 201]
    assert fake.request_count == 4


async def test_script_for_model(fake: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake.script_for_model("gpt-4o", [Fault(status=500)])
    fake.script([Fault(status=502)])
    assert (await post(session, fake, model="other"))[0] == 502
    assert (await post(session, fake, model="gpt-4o"))[0] == 500
    assert (await post(session, fake, model="gpt-4o"))[0] == 200


async def test_fault_header(fake: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake.script([Fault(status=500)])
    hdr = {"x-fake-fault": json.dumps({"status": 418, "retry_after": "3", "body": "teapot"})}
    async with session.post(fake.url + CHAT, json={}, headers=hdr) as r:
        assert (r.status, r.headers["Retry-After"], await r.read()) == (418, "3", b"teapot")
    async with session.post(
        fake.url + CHAT, json={}, headers={"x-fake-fault": '{"hold_headers": 1}'}
    ) as r:
        assert r.status == 400
        assert "unknown fault fields: hold_headers" in (await r.json())["error"]["message"]
    assert (await post(session, fake))[0] == 500  # the header consumed no script entry


async def test_fault_header_aimed_at_named_fakes(session: aiohttp.ClientSession) -> None:
    """``x-fake-fault-for`` (issue 23 item 7): the fault applies only on the fakes it
    names; elsewhere the request is answered as without the header (script, default)."""
    fault = {"x-fake-fault": '{"status": 503}'}
    async with FakeUpstream(name="primary") as primary, FakeUpstream() as unnamed:
        primary.script([Fault(status=429)])

        async def status(fake: FakeUpstream, headers: dict[str, str]) -> int:
            async with session.post(fake.url + CHAT, json={}, headers=headers) as r:
                return r.status

        assert await status(primary, {**fault, "x-fake-fault-for": "backup"}) == 429  # script
        assert await status(primary, {**fault, "x-fake-fault-for": "backup"}) == 200  # default
        assert await status(primary, {**fault, "x-fake-fault-for": "primary"}) == 503
        assert await status(primary, {**fault, "x-fake-fault-for": "backup, primary"}) == 503
        assert await status(primary, {**fault, "x-fake-fault-for": "Primary"}) == 200  # exact
        assert await status(primary, fault) == 503  # no -for: every fake, as before
        assert await status(unnamed, {**fault, "x-fake-fault-for": "primary"}) == 200
        assert await status(unnamed, fault) == 503
        assert [r.fault.status for r in primary.requests] == [429, 200, 503, 503, 200, 503]


def test_fault_from_json() -> None:
    f = fault_from_json('{"status": 503, "chunk_delay_ms": 5, "headers": {"a": "b"}}')
    assert f == Fault(status=503, chunk_delay_ms=5.0, headers={"a": "b"})
    with pytest.raises(ValueError, match="status"):
        fault_from_json('{"status": "x"}')
    with pytest.raises(ValueError, match="JSON object"):
        fault_from_json("[]")


# -- connections ------------------------------------------------------------------


async def test_connections_accepted_counts_tcp_accepts(fake: FakeUpstream) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(fake.url + CHAT, json={}) as r:
                await r.read()
        assert (fake.connections_accepted, fake.open_connections) == (1, 1)
        assert [r.connection for r in fake.requests] == [1, 1]
        fake.script([Fault(keep_alive=False)])
        for _ in range(2):
            async with s.post(fake.url + CHAT, json={}) as r:
                await r.read()
        assert fake.connections_accepted == 2
    async with aiohttp.ClientSession() as s, s.get(fake.url + "/v1/models") as r:
        await r.read()
    assert fake.connections_accepted == 3
    await fake.wait_until(lambda: fake.open_connections == 0)


async def test_refused_connection_counts_nothing(session: aiohttp.ClientSession) -> None:
    fake = await FakeUpstream().start()
    url = fake.url
    await fake.close()
    with pytest.raises(aiohttp.ClientConnectorError):
        await session.get(url + "/v1/models")
    assert fake.connections_accepted == 0


async def test_closed_port_is_refused(session: aiohttp.ClientSession) -> None:
    with pytest.raises(aiohttp.ClientConnectorError):
        await session.get(f"http://127.0.0.1:{closed_port()}/")


async def test_saturated_listener_connect_times_out() -> None:
    host, port, cleanup = await saturated_listener()
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.open_connection(host, port), 0.2)
        timeout = aiohttp.ClientTimeout(sock_connect=0.2)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            with pytest.raises(aiohttp.ConnectionTimeoutError):
                await s.get(f"http://{host}:{port}/")
    finally:
        cleanup()
    cleanup()  # idempotent
    with pytest.raises(ConnectionRefusedError):  # the listener is gone
        await asyncio.open_connection(host, port)


# -- command line -------------------------------------------------------------------


async def test_cli_serves_and_stops(session: aiohttp.ClientSession) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar.testing",
        "--port",
        "0",
        "--fail-first",
        "1",
        "--status",
        "503",
        "--retry-after",
        "2",
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode()
        assert line.startswith("listening on http://127.0.0.1:")
        url = line.split()[-1]
        async with session.post(url + CHAT, json={"model": "m"}) as r:
            assert (r.status, r.headers["Retry-After"]) == (503, "2")
        async with session.post(url + CHAT, json={"model": "m"}) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 15) == 0

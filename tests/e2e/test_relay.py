"""The relay on its good path, black-box through the running sidecar.

Bytes relayed unchanged (JSON, binary, SSE, gzip), SSE events passed on one at a
time (never buffered), redirects relayed and not followed, empty bodies, the
request path/query/method/body as received, and bodies past aiohttp's 1 MiB
default.

Byte comparisons: the sidecar fronts ``fake`` while the same request goes
directly to ``fake2``; both are fresh fakes (same request index, so the same
generated ids) and the generated ``created`` stamps are pinned, so the two
answers must be the same bytes.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp
import pytest
from yarl import URL

from sidecar.testing import FakeUpstream, Fault, shapes
from tests.configs import fallback, single
from tests.conftest import StartSidecar

CHAT = "/v1/chat/completions"
GUARD_S = 5.0  # fail fast instead of hanging until the global timeout


RETRY = {"max_retries": 2, "backoff_initial_ms": 10}
"""Retries on, fast backoff (ms)."""


def one_upstream(url: str, *, server: dict[str, int] | None = None) -> str:
    """One upstream ``primary`` behind the route ``all`` on ``/`` (``RETRY``); a
    ``[server]`` table always (empty when ``server`` is None)."""
    return single(url, server=server or {}, retry=RETRY, route_name="all", path_prefix="/")


def two_upstreams(a: str, b: str) -> str:
    """``primary`` (``RETRY``) then ``backup`` behind the route ``chat`` on ``/v1/``."""
    return fallback(a, b, primary={"retry": RETRY})


@pytest.fixture(autouse=True)
def pinned_created(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated bodies carry ``created: int(time.time())``: pin it so answers compare."""
    monkeypatch.setattr(shapes, "time", SimpleNamespace(time=lambda: 1767225600.0))


# -- bytes ----------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/v1/responses", "/v1/embeddings"])
async def test_json_answer_is_relayed_byte_for_byte(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    path: str,
) -> None:
    sc = await start_sidecar(one_upstream(fake.url))
    body = b'{"model": "gpt-4o",  "input": "hi", "messages": [{"role": "user", "content": "hi"}]}'
    async with http.post(fake2.url + path, data=body) as direct:
        want = await direct.read()
        want_type = direct.headers["Content-Type"]
    async with http.post(sc.proxy_url + path, data=body) as r:
        got = await r.read()
        assert r.status == 200
        assert r.headers["Content-Type"] == want_type
        assert r.headers["Content-Length"] == str(len(want))
        assert r.headers["x-sidecar-upstream"] == "primary"
        assert r.headers["x-sidecar-attempts"] == "1"
    assert got == want
    assert fake.request_count == 1
    assert fake.requests[0].body == body


async def test_binary_body_is_relayed_byte_for_byte(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    raw = bytes(range(256)) * 64 + b"\r\n\r\n\x00tail"
    fake.set_default(Fault(body=raw, content_type="application/octet-stream", chunks=7))
    sc = await start_sidecar(one_upstream(fake.url))
    upload = bytes(reversed(raw))
    async with http.post(sc.proxy_url + "/v1/files", data=upload) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "application/octet-stream"
        assert await r.read() == raw
    assert fake.requests[0].body == upload


async def test_large_answer_is_relayed_byte_for_byte(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    raw = bytes((i * 7919) % 256 for i in range(6 * 1024 * 1024))
    fake.set_default(Fault(body=raw, content_type="application/octet-stream", chunks=48))
    sc = await start_sidecar(one_upstream(fake.url))
    async with http.get(sc.proxy_url + "/v1/files/f1/content") as r:
        assert r.status == 200
        assert r.headers["Content-Length"] == str(len(raw))
        assert await r.read() == raw


async def test_head_is_relayed(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(one_upstream(fake.url))
    async with http.head(sc.proxy_url + "/v1/models") as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "primary"
        assert await r.read() == b""
    assert fake.request_count == 1
    assert fake.requests[0].method == "HEAD"


@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/v1/responses"])
async def test_sse_stream_is_relayed_byte_for_byte(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    path: str,
) -> None:
    sc = await start_sidecar(one_upstream(fake.url))
    request = {"model": "gpt-4o", "stream": True, "messages": [], "max_tokens": 5}
    async with http.post(fake2.url + path, json=request) as direct:
        want = await direct.read()
    async with http.post(sc.proxy_url + path, json=request) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["Cache-Control"] == "no-cache"
        assert "Content-Length" not in r.headers
        got = await r.read()
    assert got == want
    assert got.count(b"\n\n") >= 6
    if path == CHAT:
        assert got.endswith(b"data: [DONE]\n\n")


async def test_sse_events_reach_the_client_one_at_a_time(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """The client reads the first output event while the fake still holds the next one:
    nothing is buffered after the commit point (the role-only first chunk carries no
    output: it is held, then sent with the first content event; "Streamed answers")."""
    request = {"model": "gpt-4o", "stream": True}
    async with http.post(fake2.url + CHAT, json=request) as direct:
        want = await direct.read()
    role_end = want.index(b"\n\n") + 2
    first_events = want[: want.index(b"\n\n", role_end) + 2]

    gate_3 = asyncio.Event()
    fake.script([Fault(hold_after_chunks=(2, gate_3))])
    sc = await start_sidecar(one_upstream(fake.url))
    async with http.post(sc.proxy_url + CHAT, json=request) as r:
        assert r.status == 200
        async with asyncio.timeout(GUARD_S):
            got_first = await r.content.readuntil(b"\n\n")
            got_first += await r.content.readuntil(b"\n\n")
        assert got_first == first_events
        gate_2 = gate_3
        assert not gate_2.is_set()
        assert fake.active_requests == 1  # the fake is still holding the rest
        gate_2.set()
        rest = await r.read()
    assert got_first + rest == want


async def test_every_sse_event_is_passed_on_before_the_next_is_sent(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """Event by event from the first output event on: each one arrives while the fake
    holds the one after it (the role-only chunk before it is held until it comes)."""
    sc = await start_sidecar(one_upstream(fake.url))
    events = shapes.chat_completion_stream("gpt-4o", ["a", "b", "c"], rid="chatcmpl-x")
    for n in range(2, len(events)):
        gate = asyncio.Event()
        fake.script([Fault(text="abc", chunks=3, hold_after_chunks=(n, gate))])
        async with http.post(sc.proxy_url + CHAT, json={"model": "gpt-4o", "stream": True}) as r:
            assert r.status == 200
            received = b""
            async with asyncio.timeout(GUARD_S):
                for _ in range(n):
                    received += await r.content.readuntil(b"\n\n")
            assert received.count(b"\n\n") == n
            assert not gate.is_set()
            gate.set()
            received += await r.read()
        assert received.count(b"\n\n") == len(events)
        assert received.endswith(b"data: [DONE]\n\n")


# -- compression ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_gzip_answer_passes_through_compressed(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    stream: bool,
) -> None:
    fake.set_default(Fault(gzip=True))
    fake2.set_default(Fault(gzip=True))
    sc = await start_sidecar(one_upstream(fake.url))
    request = {"model": "gpt-4o", "stream": stream}
    headers = {"Accept-Encoding": "gzip, br;q=0.5"}
    async with http.post(fake2.url + CHAT, json=request, headers=headers) as direct:
        want = await direct.read()
    async with http.post(sc.proxy_url + CHAT, json=request, headers=headers) as r:
        assert r.status == 200
        assert r.headers["Content-Encoding"] == "gzip"
        got = await r.read()
    assert got == want
    text = gzip.decompress(got)
    assert b"Hello" in text
    assert fake.requests[0].headers.getall("Accept-Encoding") == ["gzip, br;q=0.5"]


async def test_no_accept_encoding_is_added(
    fake: FakeUpstream, fake2: FakeUpstream, start_sidecar: StartSidecar
) -> None:
    sc = await start_sidecar(one_upstream(fake.url))
    skip = ["Accept-Encoding"]
    async with aiohttp.ClientSession(auto_decompress=False, skip_auto_headers=skip) as plain:
        # control: this client really sends no Accept-Encoding
        async with plain.post(fake2.url + CHAT, json={"model": "m"}) as direct:
            assert direct.status == 200
        assert "Accept-Encoding" not in fake2.requests[0].headers
        async with plain.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
            assert r.status == 200
            assert "Content-Encoding" not in r.headers
            assert b"Hello" in await r.read()
    assert "Accept-Encoding" not in fake.requests[0].headers


# -- status codes the relay passes on -------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_redirect_is_relayed_not_followed(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    status: int,
) -> None:
    location = f"{fake2.url}/v1/elsewhere"
    fake.set_default(Fault(status=status, headers={"Location": location}))
    sc = await start_sidecar(two_upstreams(fake.url, fake2.url))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}, allow_redirects=False) as r:
        assert r.status == status
        assert r.headers["Location"] == location
        assert r.headers["x-sidecar-upstream"] == "primary"
        assert r.headers["x-sidecar-attempts"] == "1"
        await r.read()
    assert fake.request_count == 1
    assert fake2.request_count == 0


async def test_empty_200_is_relayed_as_is_not_retried(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    fake.set_default(Fault(empty_body=True))
    sc = await start_sidecar(two_upstreams(fake.url, fake2.url))
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200
        assert await r.read() == b""
        assert r.headers["Content-Length"] == "0"
        assert r.headers["x-sidecar-upstream"] == "primary"
        assert r.headers["x-sidecar-attempts"] == "1"
    assert fake.request_count == 1
    assert fake2.request_count == 0


async def test_204_is_relayed(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    fake.set_default(Fault(status=204))
    sc = await start_sidecar(one_upstream(fake.url))
    async with http.delete(sc.proxy_url + "/v1/files/f1") as r:
        assert r.status == 204
        assert await r.read() == b""
    assert fake.request_count == 1
    assert fake.requests[0].method == "DELETE"


# -- the request as received ----------------------------------------------------


async def test_path_and_query_are_appended_to_base_url_as_received(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """``base_url`` (trailing slash dropped) + the request's path and query, unchanged:
    the fake sees what it sees when sent the same target directly."""
    sc = await start_sidecar(one_upstream(fake.url + "/openai/"))
    target = "/v1/echo/a%2Fb/c%20d?x=1&y=%20z&x=2&e="
    async with http.get(URL(fake2.url + "/openai" + target, encoded=True)) as direct:
        assert direct.status == 200
    async with http.get(URL(sc.proxy_url + target, encoded=True)) as r:
        assert r.status == 200
        await r.read()
    got, want = fake.requests[0], fake2.requests[0]
    assert got.method == "GET"
    assert got.path == want.path
    assert got.path.startswith("/openai/v1/echo/")
    assert got.query_string == want.query_string
    assert got.body == b""


@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE", "OPTIONS"])
async def test_method_and_body_pass_through(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession, method: str
) -> None:
    sc = await start_sidecar(one_upstream(fake.url))
    body = b"not json at all \xff"
    async with http.request(method, sc.proxy_url + "/echo/x", data=body) as r:
        assert r.status == 200
        doc = json.loads(await r.read())
    assert doc["method"] == method
    assert fake.requests[0].body == body


async def test_two_mib_body_passes_under_a_four_mib_limit(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """aiohttp's 1 MiB ``client_max_size`` default must not apply; the body goes on
    with its ``Content-Length`` (sent from an ``io.BytesIO`` on both sides: aiohttp
    warns of a ``bytes`` body over 1 MiB)."""
    sc = await start_sidecar(one_upstream(fake.url, server={"max_request_body_bytes": 4194304}))
    body = bytes(i % 251 for i in range(2 * 1024 * 1024))
    async with http.post(sc.proxy_url + "/echo/upload", data=io.BytesIO(body)) as r:
        assert r.status == 200
        await r.read()
    assert fake.requests[0].body == body
    assert fake.requests[0].headers.getall("Content-Length") == [str(len(body))]
    assert "Transfer-Encoding" not in fake.requests[0].headers


async def test_two_mib_chunked_body_passes_under_a_four_mib_limit(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(one_upstream(fake.url, server={"max_request_body_bytes": 4194304}))
    piece = bytes(i % 253 for i in range(64 * 1024))

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(32):
            yield piece

    async with http.post(sc.proxy_url + "/echo/upload", data=chunks()) as r:
        assert r.status == 200
        await r.read()
    assert fake.requests[0].body == piece * 32
    assert fake.requests[0].headers.getall("Content-Length") == [str(len(piece) * 32)]

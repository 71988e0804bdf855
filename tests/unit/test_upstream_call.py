"""``sidecar.wire.upstream_call.call`` sends what ``ClientSession._request`` sends and
fails as it fails.

The sidecar skips aiohttp's general request path (``sidecar.wire.upstream_call``) but keeps
its request, connector, parser and response objects. These tests put both paths
against the same raw loopback server: the request bytes on the wire, the response
seen, and the exception for each failure must be equal, and the aiohttp internals
``call`` uses must still have the shape it calls them with.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.client_proto import ResponseHandler
from yarl import URL

from sidecar.testing.scripted import through_session as via_session
from sidecar.wire.upstream_call import call
from sidecar.wire.upstream_request import INLINE_BODY_MAX, SKIP_AUTO_HEADERS, UpstreamRequest

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class RawServer:
    """A loopback server that records each request's bytes and answers ``reply`` (or closes)."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.reply: bytes | None = OK
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length) if length else b""
        self.requests.append(head + body)
        if self.reply is not None:  # a HEAD answer has no body (RFC 9110 section 9.3.2)
            writer.write(
                self.reply.split(b"\r\n\r\n")[0] + b"\r\n\r\n"
                if head.startswith(b"HEAD")
                else self.reply
            )
            await writer.drain()
        writer.close()


@pytest_asyncio.fixture
async def raw() -> AsyncIterator[RawServer]:
    server = RawServer()
    await server.start()
    yield server
    assert server.server is not None
    server.server.close()
    await server.server.wait_closed()


def new_session(
    request_class: type[aiohttp.ClientRequest] = UpstreamRequest,
) -> aiohttp.ClientSession:
    """A session made as ``Upstream.start`` makes it (or with another ``request_class``)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=4, limit_per_host=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0),
        auto_decompress=False,
        skip_auto_headers=SKIP_AUTO_HEADERS,
        request_class=request_class,
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
        max_line_size=65536,
        max_field_size=65536,
    )


CASES = [
    ("POST", [("Content-Type", "application/json"), ("Authorization", "Bearer k")], b'{"a":1}'),
    ("POST", [("X-Trace", "1"), ("X-Trace", "2")], None),
    ("GET", [("Accept", "text/event-stream")], None),
    ("HEAD", [], None),
    ("PUT", [("Content-Length", "3")], b"abc"),
]


@pytest.mark.parametrize(("method", "headers", "data"), CASES)
async def test_same_bytes_on_the_wire_and_same_response(
    raw: RawServer, method: str, headers: list[tuple[str, str]], data: bytes | None
) -> None:
    url = URL(f"http://127.0.0.1:{raw.port}/v1/chat/completions?x=1", encoded=True)
    seen = []
    for send in (via_session, call):
        async with new_session() as session:
            resp = await send(session, method, url, headers, data)
            body = await resp.read()
            seen.append((resp.status, list(resp.headers.items()), body))
            resp.release()
    assert len(raw.requests) == 2
    assert raw.requests[0] == raw.requests[1]
    assert seen[0] == seen[1]


async def test_fields_whose_names_differ_only_in_case_are_all_sent(raw: RawServer) -> None:
    # aiohttp's session path kept only the last of them (``_prepare_headers`` replaces
    # a name it has not seen in that exact case); a relay sends every field it got.
    url = URL(f"http://127.0.0.1:{raw.port}/v1/x", encoded=True)
    async with new_session() as session:
        resp = await call(session, "POST", url, [("X-Trace", "1"), ("x-trace", "2")], None)
        resp.release()
    assert b"\r\nX-Trace: 1\r\nx-trace: 2\r\n" in raw.requests[0]


@pytest.mark.parametrize(
    "size",
    [1, INLINE_BODY_MAX, INLINE_BODY_MAX + 1, 3 * 0x10000],  # written inline, then by a task
)
@pytest.mark.parametrize("reply", [OK, None])
async def test_upstream_request_sends_and_fails_as_aiohttps_request(
    raw: RawServer, size: int, reply: bytes | None
) -> None:
    # UpstreamRequest.send writes a small body inline (no writer task) on Python 3.11.
    raw.reply = reply
    url = URL(f"http://127.0.0.1:{raw.port}/v1/chat/completions", encoded=True)
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    seen: list[object] = []
    for request_class in (aiohttp.ClientRequest, UpstreamRequest):
        async with new_session(request_class) as session:
            try:
                resp = await call(session, "POST", url, [("Content-Type", "text/plain")], body)
            except aiohttp.ClientError as exc:
                seen.append((type(exc), str(exc)))
                continue
            seen.append((resp.status, list(resp.headers.items()), await resp.read()))
            resp.release()
    assert len(raw.requests) == 2
    assert raw.requests[0] == raw.requests[1]
    assert raw.requests[0].endswith(b"\r\n\r\n" + body)
    assert seen[0] == seen[1]
    if reply is None:
        assert seen[0] == (aiohttp.ServerDisconnectedError, "Server disconnected")


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (None, aiohttp.ServerDisconnectedError),
        (b"HTTP/1.1 2x\r\n\r\n", aiohttp.ClientResponseError),
    ],
)
async def test_same_error_when_the_answer_breaks(
    raw: RawServer, reply: bytes | None, error: type[Exception]
) -> None:
    raw.reply = reply
    url = URL(f"http://127.0.0.1:{raw.port}/v1/x", encoded=True)
    for send in (via_session, call):
        async with new_session() as session:
            with pytest.raises(error):
                await send(session, "POST", url, [], b"{}")


async def test_same_error_when_the_connection_is_refused(raw: RawServer) -> None:
    assert raw.server is not None
    raw.server.close()
    await raw.server.wait_closed()
    url = URL(f"http://127.0.0.1:{raw.port}/v1/x", encoded=True)
    for send in (via_session, call):
        async with new_session() as session:
            with pytest.raises(aiohttp.ClientConnectorError):
                await send(session, "POST", url, [], b"{}")


async def test_a_connect_timeout_is_a_connection_timeout_error(
    raw: RawServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def times_out(*args: object, **kwargs: object) -> None:
        raise TimeoutError

    monkeypatch.setattr(aiohttp.TCPConnector, "connect", times_out)
    url = URL(f"http://127.0.0.1:{raw.port}/v1/x", encoded=True)
    for send in (via_session, call):
        async with new_session() as session:
            with pytest.raises(aiohttp.ConnectionTimeoutError):
                await send(session, "POST", url, [], b"{}")


async def test_the_aiohttp_internals_used_still_have_their_shape() -> None:
    params = inspect.signature(ResponseHandler.set_response_params).parameters
    for name in ("timer", "skip_payload", "read_until_eof", "auto_decompress", "read_timeout",
                 "read_bufsize", "timeout_ceil_threshold", "max_line_size", "max_field_size",
                 "max_headers"):  # fmt: skip
        assert name in params, name
    assert list(inspect.signature(aiohttp.BaseConnector.connect).parameters) == [
        "self", "req", "traces", "timeout"
    ]  # fmt: skip
    # The steps UpstreamRequest.send repeats are still those of ClientRequest.send.
    source = inspect.getsource(aiohttp.ClientRequest.send)
    for step in ("if hdrs.CONNECTION not in self.headers:", "if conn._connector.force_close:",
                 'status_line = f"{self.method} {path} HTTP/{v.major}.{v.minor}"',
                 "await writer.write_headers(status_line, self.headers)",
                 "coro = self.write_bytes(writer, conn, self._get_content_length())",
                 "task = None", "writer=task,", "continue100=self._continue,",
                 "stream_writer=writer,",
                 "hdrs.CONTENT_TYPE not in self._skip_auto_headers"):  # fmt: skip
        assert step in source, step
    for attr in ("_body", "_continue", "_traces", "_upload_tracker", "_timer", "_session"):
        assert attr in inspect.getsource(aiohttp.ClientRequest), attr
    source = inspect.getsource(aiohttp.ClientSession._request)
    for step in ("self._connector.connect(", "conn.protocol.set_response_params(",
                 "await req.send(conn)", "await resp.start(conn)"):  # fmt: skip
        assert step in source, step  # the steps call() repeats are still aiohttp's own
    session = new_session()
    try:
        for attr in ("_request_class", "_response_class", "_read_bufsize", "_max_line_size",
                     "_max_field_size", "_max_headers", "_loop"):  # fmt: skip
            assert hasattr(session, attr), attr
        assert hasattr(session.connector, "_timeout_ceil_threshold")
    finally:
        await session.close()


async def test_a_body_read_to_its_end_has_given_its_connection_back(raw: RawServer) -> None:
    # The relay skips ``release()`` for such a response (``ClientResponse.closed``).
    url = URL(f"http://127.0.0.1:{raw.port}/v1/x", encoded=True)
    async with new_session() as session:
        resp = await call(session, "POST", url, [], b"{}")
        assert await resp.content.readany() == b"{}"
        assert resp.content.at_eof()
        assert resp.closed and resp.connection is None

"""``whole_answer.send_whole`` puts on the wire what ``web.Response(body=...)`` puts there.

The relay sends a whole JSON answer through ``send_whole`` instead of aiohttp's
``web.Response`` machinery (``sidecar.wire.whole_answer``). A real aiohttp low-level
server answers the same raw request both ways; the bytes the client reads, and
whether the connection is kept, must be equal for every keep-alive case of
HTTP/1.0 and 1.1 and with or without the headers aiohttp adds, but one: an answer
without ``Content-Type`` gets none (aiohttp adds ``application/octet-stream``).
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.http import StreamWriter
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict

from sidecar.wire.whole_answer import raw_head, send_whole, sendable_whole

BODY = b'{"id":"chatcmpl-1","object":"chat.completion"}'


async def handler(request: web.BaseRequest) -> web.StreamResponse:
    fields = request.headers.get("X-Fields", "")
    extra = [(name, value) for name, _, value in (f.partition("=") for f in fields.split(";") if f)]
    if request.headers["X-Way"] == "aiohttp":
        answer: web.StreamResponse = web.Response(status=200, reason="OK", body=BODY)
    else:
        answer = web.StreamResponse(status=200, reason="OK")
    if "X-No-Length" not in request.headers:  # the relayed upstream Content-Length
        answer.headers["Content-Length"] = str(len(BODY))
    answer.headers.extend(extra)
    if request.headers["X-Way"] == "aiohttp":
        await answer.prepare(request)
        await answer.write_eof()
    else:
        assert sendable_whole(request, 200, BODY)
        await send_whole(request, answer, BODY)
    return answer


@pytest_asyncio.fixture
async def port() -> AsyncIterator[int]:
    runner = web.ServerRunner(web.Server(handler))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield runner.addresses[0][1]
    await runner.cleanup()


async def exchange(port: int, head: str) -> tuple[bytes, bool]:
    """Send ``head``, then again once its answer is read; the first answer's bytes, and
    whether the server answered the second request too (the connection was kept)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode())
        answer = await reader.readuntil(b"\r\n\r\n")
        assert re.match(rb"HTTP/1\.[01] 200 OK\r\n", answer), answer
        length = int(re.search(rb"Content-Length: (\d+)", answer).group(1))  # type: ignore[union-attr]
        answer += await reader.readexactly(length)
        try:  # the second answer's head, or the close after the first answer
            writer.write(head.encode())
            await reader.readuntil(b"\r\n\r\n")
            kept = True
        except (asyncio.IncompleteReadError, ConnectionResetError):
            kept = False
        return re.sub(rb"Date: [^\r]*\r\n", b"Date: -\r\n", answer), kept
    finally:
        writer.close()


@pytest.mark.parametrize(
    "version_and_connection",
    ["HTTP/1.1", "HTTP/1.1\r\nConnection: close", "HTTP/1.0", "HTTP/1.0\r\nConnection: keep-alive"],
)
@pytest.mark.parametrize(
    "fields",
    [
        "",
        "Content-Type=application/json",
        "Content-Type=application/json;Date=Tue, 01 Dec 2026 10:00:00 GMT;Server=up/1",
    ],
)
@pytest.mark.parametrize("length", ["X-Length: relayed", "X-No-Length: lost as hop-by-hop"])
async def test_same_bytes_and_keep_alive_as_web_response(
    port: int, version_and_connection: str, fields: str, length: str
) -> None:
    version, _, connection = version_and_connection.partition("\r\n")
    seen = []
    for way in ("aiohttp", "sidecar"):
        head = f"POST /v1/chat/completions {version}\r\nHost: x\r\nX-Way: {way}\r\n"
        head += f"X-Fields: {fields}\r\n{length}\r\n" + (connection + "\r\n" if connection else "")
        seen.append(await exchange(port, head + "Content-Length: 0\r\n\r\n"))
    if "Content-Type" not in fields:
        # The one difference, by design: no Content-Type is added (RFC 9110 section 8.3).
        added = b"Content-Type: application/octet-stream\r\n"
        assert added in seen[0][0]
        seen[0] = (seen[0][0].replace(added, b""), seen[0][1])
        assert b"Content-Type" not in seen[1][0]
    assert seen[0] == seen[1]
    kept = (version == "HTTP/1.1" and not connection) or connection == "Connection: keep-alive"
    assert seen[0][1] is kept


def test_not_for_answers_without_a_body() -> None:
    class Head:
        method = "HEAD"

    class Post:
        method = "POST"

    assert not sendable_whole(Head(), 200, BODY)  # type: ignore[arg-type]
    for status in (101, 204, 304):
        assert not sendable_whole(Post(), status, BODY)  # type: ignore[arg-type]
    assert not sendable_whole(Post(), 200, b"")  # type: ignore[arg-type]
    assert sendable_whole(Post(), 200, BODY)  # type: ignore[arg-type]


def test_the_aiohttp_steps_repeated_are_still_aiohttps() -> None:
    source = inspect.getsource(web.StreamResponse._prepare_headers)
    for step in ("headers.setdefault(hdrs.CONTENT_TYPE, \"application/octet-stream\")",
                 "headers[hdrs.DATE] = rfc822_formatted_time()",
                 "headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)",
                 'headers[hdrs.CONNECTION] = "keep-alive"', 'headers[hdrs.CONNECTION] = "close"',
                 "keep_alive = request.keep_alive"):  # fmt: skip
        assert step in source, step
    source = inspect.getsource(web.Response._start)
    assert "self._headers[hdrs.CONTENT_LENGTH] = str(body_len)" in source
    source = inspect.getsource(web.StreamResponse.write_eof)
    for step in ("self._eof_sent = True", "self._body_length = self._payload_writer.output_size"):
        assert step in source, step
    assert "if self._eof_sent:" in inspect.getsource(web.StreamResponse.prepare)
    assert "_keep_alive" in inspect.getsource(web.StreamResponse.keep_alive.fget)  # type: ignore[attr-defined]


def test_the_steps_relayed_answer_and_raw_head_rely_on_are_still_aiohttps() -> None:
    """``RelayedAnswer`` repeats ``_write_headers``'s status line and replaces the head
    ``StreamWriter.write_headers`` buffered before it is sent (``keep_raw_head``)."""
    source = inspect.getsource(web.StreamResponse._write_headers)
    for step in (
        'status_line = f"HTTP/{version[0]}.{version[1]} {self._status} {self._reason}"',
        "await writer.write_headers(status_line, self._headers)",
    ):
        assert step in source, step
    assert "await self._write_headers()" in inspect.getsource(web.StreamResponse._start)
    source = inspect.getsource(StreamWriter.write_headers)
    for step in ("self._headers_written = False", "self._headers_buf = buf"):
        assert step in source, step
    for method in (StreamWriter.send_headers, StreamWriter.set_eof):
        assert "headers_buf = self._headers_buf" in inspect.getsource(method)


@pytest.mark.parametrize("value", ["v", "caf\u00e9 \u2603", ""])
def test_raw_head_is_aiohttps_serialization_for_a_head_aiohttp_keeps(value: str) -> None:
    headers = CIMultiDict([("Content-Type", "text/plain"), ("X-A", value), ("x-a", "2")])
    line = "HTTP/1.1 200 OK"
    assert raw_head(line, headers) == _serialize_headers(line, headers)


def test_raw_head_writes_obs_text_back() -> None:
    value = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")
    assert (
        raw_head("GET / HTTP/1.1", {"X-A": value}) == b"GET / HTTP/1.1\r\nX-A: caf\xe9 \xff\r\n\r\n"
    )

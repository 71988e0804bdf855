"""A relayed answer whose whole body is in hand (a typical JSON answer), sent in one write.

What ``web.Response(body=...)`` and its ``prepare`` / ``write_eof`` send for such an
answer, without their general machinery (compression, cookies, chunking, the
length checks of a body still to come): about 500 bytecodes of aiohttp's per
request, 6% of a proxied JSON request. The head and the body still go out
through aiohttp's own writer (``request.writer``: its header serialization and
its one coalesced write). ``tests/unit/test_whole_answer.py`` checks that the
bytes on the wire are those of ``web.Response``, and pins the aiohttp steps
repeated here.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion10, HttpVersion11, StreamWriter

__all__ = [
    "RelayedAnswer",
    "ends_at_close",
    "raw_head",
    "send_closing",
    "send_whole",
    "sendable_whole",
]


def raw_head(status_line: str, headers: Mapping[str, str]) -> bytes:
    """A message head as aiohttp's writer serializes it, but with each value's obs-text
    octets (RFC 9110 section 5.5: 0x80-0xFF that are not UTF-8, which aiohttp's parsers
    keep as surrogate escapes) written back as the octets they were: aiohttp's C writer
    drops them. For a head that aiohttp's writer has already taken (it refuses control
    characters); only ever called on a head with a byte outside ASCII."""
    fields = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"{status_line}\r\n{fields}\r\n".encode("utf-8", "surrogateescape")


def keep_raw_head(
    writer: AbstractStreamWriter, status_line: str, headers: Mapping[str, str]
) -> None:
    """Replace the head ``writer.write_headers`` buffered (not yet sent) with :func:`raw_head`."""
    assert isinstance(writer, StreamWriter) and not writer._headers_written
    writer._headers_buf = raw_head(status_line, headers)


class RelayedAnswer(web.StreamResponse):
    """A streamed relayed answer whose head aiohttp's ``prepare`` would change: one the
    upstream sent without ``Content-Type`` (aiohttp adds ``application/octet-stream``; RFC
    9110 section 8.3: a recipient may sniff an unlabelled body, a proxy does not label
    it), or one with octets outside ASCII in its fields (:func:`raw_head`). Used only for
    those; every other answer is a plain ``web.StreamResponse``."""

    def __init__(self, status: int, reason: str | None, *, unlabelled: bool, raw: bool) -> None:
        super().__init__(status=status, reason=reason)
        self.unlabelled = unlabelled
        self.raw = raw

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        if self.unlabelled:
            self.headers.popall(hdrs.CONTENT_TYPE, None)

    async def _write_headers(self) -> None:
        if not self.raw:
            await super()._write_headers()
            return
        request = self._req
        writer = self._payload_writer
        assert request is not None and writer is not None
        version = request.version
        status_line = f"HTTP/{version[0]}.{version[1]} {self.status} {self.reason}"
        await writer.write_headers(status_line, self.headers)
        keep_raw_head(writer, status_line, self.headers)


def sendable_whole(request: web.BaseRequest, status: int, body: bytes) -> bool:
    """Whether :func:`send_whole` may send ``body`` as the whole answer to ``request``.

    Not for a request or status whose answer has no body (HEAD, 1xx, 204, 304:
    RFC 9110 sections 9.3.2, 15.3.5, 15.4.5), nor for an empty body; those take
    the relay's streaming path (``StreamResponse.prepare``, which knows them).
    """
    return bool(body) and not must_be_empty_body(request.method, status)


def ends_at_close(request: web.BaseRequest, status: int, headers: Mapping[str, str]) -> bool:
    """Whether an answer streamed to ``request`` with ``headers`` can only end at the
    connection's close: an HTTP/1.0 client (no chunked coding, RFC 9112 section 6.3),
    no ``Content-Length``, and a status and method whose answer has a body."""
    return (
        request.version < HttpVersion11
        and hdrs.CONTENT_LENGTH not in headers
        and not must_be_empty_body(request.method, status)
    )


async def send_whole(
    request: web.BaseRequest, answer: web.StreamResponse, body: bytes, *, raw: bool = False
) -> None:
    """Send ``answer`` (status, reason, headers already set) with ``body`` as its whole body.

    ``answer.headers`` normally holds the body's ``Content-Length`` (the
    upstream's own, relayed); when it has none (an upstream answer that names
    ``Content-Length`` in its ``Connection`` field loses it as hop-by-hop), the
    body's length is set, as ``web.Response._start`` does: without it the answer
    would have no framing on a kept-alive connection. As
    ``StreamResponse._prepare_headers`` does, this then adds ``Date`` when absent,
    ``Server`` when absent, and the
    ``Connection`` field of the connection's keep-alive state (``keep-alive`` for
    an HTTP/1.0 client kept open, ``close`` for an HTTP/1.1 client not kept). The
    answer is then marked sent, as ``write_eof`` leaves it, so the server's own
    ``prepare`` / ``write_eof`` after the handler do nothing. Unlike aiohttp, no
    ``Content-Type: application/octet-stream`` is added to an answer without one (RFC
    9110 section 8.3: a recipient may sniff an unlabelled body, a proxy does not label
    it; nginx and Envoy add none).

    :param answer: a fresh, unprepared ``web.StreamResponse``.
    :param body: the whole body; :func:`sendable_whole` must be true for it.
    :param raw: the fields hold octets outside ASCII: written as they came (:func:`raw_head`).
    :raises ConnectionResetError: the client's transport is closing (aiohttp's
        ``ClientConnectionResetError``), as ``write_eof`` raises it.
    """
    keep_alive = answer.keep_alive
    if keep_alive is None:
        keep_alive = request.keep_alive
    version = request.version
    headers = answer.headers
    if hdrs.CONTENT_LENGTH not in headers:
        headers[hdrs.CONTENT_LENGTH] = str(len(body))
    if hdrs.DATE not in headers:
        headers[hdrs.DATE] = rfc822_formatted_time()
    headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
    if hdrs.CONNECTION not in headers:
        if keep_alive:
            if version == HttpVersion10:
                headers[hdrs.CONNECTION] = "keep-alive"
        elif version == HttpVersion11:
            headers[hdrs.CONNECTION] = "close"
    writer = request.writer
    status_line = f"HTTP/{version[0]}.{version[1]} {answer.status} {answer.reason}"
    await writer.write_headers(status_line, headers)
    if raw:
        keep_raw_head(writer, status_line, headers)
    await writer.write_eof(body)
    # The state StreamResponse.write_eof leaves (read by the server after the handler).
    answer._keep_alive = keep_alive
    answer._eof_sent = True
    answer._body_length = writer.output_size


async def send_closing(request: web.BaseRequest, answer: web.StreamResponse, body: bytes) -> None:
    """Send ``answer`` (status, reason, headers set) with ``body``, as ``HTTP/1.1`` whatever
    version the request line named, with ``Connection: close``; the connection is then
    closed. For the refusals of a request the sidecar does not take apart (a ``505`` to an
    ``HTTP/2.0`` request line: RFC 9112 section 2.3, a server MUST NOT send a version it
    does not conform to, so not aiohttp's status line, which echoes the request's; a
    ``501`` to a transfer coding it does not know, whose body is then left unread).
    ``Date`` and ``Server`` are added as :func:`send_whole` adds them."""
    headers = answer.headers
    headers[hdrs.CONTENT_LENGTH] = str(len(body))
    if hdrs.DATE not in headers:
        headers[hdrs.DATE] = rfc822_formatted_time()
    headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
    headers[hdrs.CONNECTION] = "close"
    writer = request.writer
    await writer.write_headers(f"HTTP/1.1 {answer.status} {answer.reason}", headers)
    await writer.write_eof(body)
    answer._keep_alive = False
    answer._eof_sent = True
    answer._body_length = writer.output_size

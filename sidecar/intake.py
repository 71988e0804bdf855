"""What the proxy takes in from the client before routing: ``Expect``, and the body.

Both run on the proxy's request handler, before any upstream is chosen.
"""

from __future__ import annotations

import asyncio

from aiohttp import hdrs, web

from sidecar.answers import Failure, Refusal
from sidecar.config import ServerConfig
from sidecar.exchange import BODY, Exchange
from sidecar.target import only_chunked
from sidecar.wire import send_continue

__all__ = ["check_expect", "read_body"]


def check_expect(request: web.BaseRequest) -> None:
    """Refuse an ``Expect`` other than ``100-continue`` as aiohttp's router does (417,
    RFC 9110 section 10.1.1), before anything else is done with the request.

    :raises aiohttp.web.HTTPExpectationFailed: an unknown expectation (HTTP/1.1 only).
    """
    value = request.headers.get(hdrs.EXPECT)
    if value is not None and request.version == (1, 1) and value.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {value}")


async def read_body(
    request: web.BaseRequest, server: ServerConfig, ex: Exchange
) -> bytes | Failure | Refusal:
    """The whole request body; a failure when over ``max_request_body_bytes`` or too slow.

    A body framed by a ``Transfer-Encoding`` other than ``chunked`` alone is refused
    unread (:data:`Refusal.CODING`, 501: RFC 9112 section 6.1): the parser removes the
    chunked coding only, so the upstream would get a still-coded body labelled plain.
    Looked at only for a request without ``Content-Length`` (the parser refuses both).

    ``Expect: 100-continue`` is answered here, after every check that could refuse the
    request before its body (the proxy's admission, the request target and ``Host``,
    the coding, the declared length): a refused client is never told to upload a body
    (contract, "The proxy port"; RFC 9110 section 10.1.1 lets a server answer the final
    status instead of 100)."""
    limit = server.max_request_body_bytes
    length = request.content_length
    if length is None:
        codings = request.headers.getall(hdrs.TRANSFER_ENCODING, ())
        if codings and not only_chunked(codings):
            return Refusal.CODING
    elif length > limit:
        return Failure.BODY_TOO_LARGE
    if hdrs.EXPECT in request.headers and request.version == (1, 1):
        await send_continue(request)  # check_expect let only 100-continue through
    content = request.content
    if content.is_eof():
        # Fast path: the whole body came with the head (most LLM requests).
        data = content.read_nowait()
        return data if len(data) <= limit else Failure.BODY_TOO_LARGE
    parts: list[bytes] = []
    size = 0
    ex.start(BODY, server.client_read_timeout_s)
    try:
        while data := await content.readany():
            size += len(data)
            if size > limit:
                return Failure.BODY_TOO_LARGE
            parts.append(data)
    except asyncio.CancelledError:
        if ex.expired() is not BODY:
            raise
        return Failure.BODY_TIMEOUT
    finally:
        ex.stop_phase()
    return b"".join(parts)

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

__all__ = ["expect_continue", "read_body"]


async def expect_continue(request: web.BaseRequest, max_body_bytes: int) -> None:
    """Answer ``Expect: 100-continue`` as aiohttp's router does (417 for any other value),
    except when the declared ``Content-Length`` is over ``max_body_bytes``: then no
    ``100 Continue`` is sent (contract, "The proxy port"), so the client is never told
    to upload a body that will be refused; :func:`read_body` answers 413 from the
    length alone (RFC 9110 section 10.1.1: a server may answer the final status
    instead of 100)."""
    if request.version == (1, 1):
        length = request.content_length
        if length is not None and length > max_body_bytes:
            return
        if request.headers[hdrs.EXPECT].lower() == "100-continue":
            await send_continue(request)
        else:
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {request.headers[hdrs.EXPECT]}")


async def read_body(
    request: web.BaseRequest, server: ServerConfig, ex: Exchange
) -> bytes | Failure | Refusal:
    """The whole request body; a failure when over ``max_request_body_bytes`` or too slow.

    A body framed by a ``Transfer-Encoding`` other than ``chunked`` alone is refused
    unread (:data:`Refusal.CODING`, 501: RFC 9112 section 6.1): the parser removes the
    chunked coding only, so the upstream would get a still-coded body labelled plain.
    Looked at only for a request without ``Content-Length`` (the parser refuses both)."""
    limit = server.max_request_body_bytes
    length = request.content_length
    if length is None:
        codings = request.headers.getall(hdrs.TRANSFER_ENCODING, ())
        if codings and not only_chunked(codings):
            return Refusal.CODING
    elif length > limit:
        return Failure.BODY_TOO_LARGE
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

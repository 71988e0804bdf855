"""After the commit point: the client gets the upstream's status, headers and body.

No retry and no replay from here on (contract, "The commit point"): an upstream
failure or an idle gap longer than ``idle_timeout_ms`` aborts the client
connection, so a truncated stream is never ended as if complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import hdrs, web

from sidecar import logs
from sidecar.exchange import IDLE, Exchange
from sidecar.headers import copy_response_headers
from sidecar.judge import SHOULD_RETRY
from sidecar.upstream import Upstream
from sidecar.wire import RelayedAnswer, ends_at_close, send_rest, send_whole, sendable_whole


async def relay(
    request: web.BaseRequest,
    response: aiohttp.ClientResponse,
    first: bytes,
    up: Upstream,
    ex: Exchange,
    *,
    no_retry: bool = False,
) -> web.StreamResponse:
    """Send the committed answer to the client and pump the rest of its body.

    :param first: the body bytes read up to the commit point (the first chunk, or a
        streamed answer's held bytes up to its first output, sent in one write;
        ``b""``: empty body).
    :param no_retry: add ``x-should-retry: false`` (decided by the request path).
    """
    complete = False
    try:
        ex.first_byte_s = ex.clock.now() - ex.started
        content = response.content
        if (
            content.at_eof()
            and hdrs.CONTENT_LENGTH in response.headers
            and sendable_whole(request, response.status, first)
        ):
            # The whole body is already here (a typical JSON answer): one write
            # carries status, headers and body, with the upstream's own framing.
            complete = True
            whole = web.StreamResponse(status=response.status, reason=response.reason)
            copy_response_headers(response.headers, whole.headers, up.name, ex.attempts)
            if no_retry:
                whole.headers[SHOULD_RETRY] = "false"
            # Sent here, not after the handler returns, so the request's duration
            # and a client leaving during the write are seen by this request.
            await send_whole(request, whole, first, raw=response.raw_head)  # type: ignore[attr-defined]
            return whole
        raw: bool = response.raw_head  # type: ignore[attr-defined]  # UpstreamResponse
        if raw or hdrs.CONTENT_TYPE not in response.headers:
            # Rare: a head aiohttp's prepare would change (RelayedAnswer).
            resp: web.StreamResponse = RelayedAnswer(
                response.status,
                response.reason,
                unlabelled=hdrs.CONTENT_TYPE not in response.headers,
                raw=raw,
            )
        else:
            resp = web.StreamResponse(status=response.status, reason=response.reason)
        copy_response_headers(response.headers, resp.headers, up.name, ex.attempts)
        if no_retry:
            resp.headers[SHOULD_RETRY] = "false"
        if ends_at_close(request, response.status, resp.headers):
            # An HTTP/1.0 body with no length ends at the close; aiohttp drops
            # ``Connection: keep-alive`` then but keeps the connection open.
            resp.force_close()
        await resp.prepare(request)
        writer = request.writer
        # The headers go out with the first bytes (``first`` may be b"": headers alone).
        await writer.write(first)
        ex.start(IDLE, up.idle_s)
        try:
            await send_rest(request, response, _on_chunk(ex))
        except asyncio.CancelledError:
            if ex.expired() is None:
                raise
            return _abort(request, resp, up, "idle_timeout", ex, "idle_timeout")
        except (aiohttp.ClientError, OSError) as exc:
            if isinstance(exc, ConnectionResetError) and request.transport is None:
                ex.client_left = True
                return resp  # the client went away
            return _abort(request, resp, up, type(exc).__name__, ex, "upstream_cut")
        ex.stop_phase()
        complete = True
        await resp.write_eof()
        return resp
    finally:
        # A body not read to its end leaves the connection unusable: close it. A
        # body read to its end has already given its connection back to the pool
        # (aiohttp closes the response at the end of its payload: ``closed``).
        if not complete:
            response.close()
        elif not response.closed:
            response.release()


def _on_chunk(ex: Exchange) -> Callable[[bytes], None]:
    """What each relayed chunk does: the idle deadline starts again from now, and an
    event stream's chunk is read for its usage (:mod:`sidecar.usage`)."""
    usage = ex.usage
    if usage is None:
        return lambda _chunk: ex.touch()
    feed, touch = usage.feed, ex.touch

    def on_chunk(chunk: bytes) -> None:
        touch()
        feed(chunk)

    return on_chunk


def _abort(
    request: web.BaseRequest,
    resp: web.StreamResponse,
    up: Upstream,
    reason: str,
    ex: Exchange,
    why: str,
) -> web.StreamResponse:
    """Cut the client connection mid-stream: never a clean end of a truncated body.

    ``reason``: what is logged (the exception's class, or ``idle_timeout``); ``why``:
    the ``reason`` of ``sidecar_stream_aborts_total`` (``upstream_cut``, ``idle_timeout``).
    """
    ex.aborted = True
    ex.abort_reason = why
    logs.event("stream_aborted", upstream=up.name, reason=reason)
    if request.transport is not None:
        request.transport.abort()
    return resp

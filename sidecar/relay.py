"""After the commit point: the client gets the upstream's status, headers and body.

No retry and no replay from here on (contract, "The commit point"): an upstream
failure or an idle gap longer than ``idle_timeout_ms`` aborts the client
connection, so a truncated stream is never ended as if complete.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import hdrs, web

from sidecar import logs
from sidecar.answers import Failure, error_answer, upstream_failure
from sidecar.exchange import FIRST_BYTE, IDLE, Exchange
from sidecar.headers import copy_response_headers
from sidecar.outcome import UpstreamError
from sidecar.upstream import Upstream, first_output


async def relay(
    request: web.BaseRequest,
    response: aiohttp.ClientResponse,
    first: bytes | None,
    up: Upstream,
    ex: Exchange,
) -> web.StreamResponse:
    """Send the committed answer to the client and pump the rest of its body.

    :param first: the first body chunk already read (``b""``: empty body), or None
        for a final failing answer whose body was not read yet (read here, under
        ``first_byte_timeout_ms``; a failure then is the sidecar's 502/504).
    """
    complete = False
    try:
        if first is None:
            ex.start(FIRST_BYTE, up.first_byte_s)
            try:
                first = await first_output(response)
            except UpstreamError as err:
                return error_answer(upstream_failure(err), request.path, ex.attempts)
            except asyncio.CancelledError:
                if ex.expired() is None:
                    raise
                return error_answer(Failure.FIRST_BYTE_TIMEOUT, request.path, ex.attempts)
            ex.stop_phase()
        content = response.content
        if (
            first
            and content.at_eof()
            and hdrs.CONTENT_LENGTH in response.headers
            and request.method != "HEAD"
        ):
            # The whole body is already here (a typical JSON answer): one write
            # carries status, headers and body, with the upstream's own framing.
            complete = True
            whole = web.Response(status=response.status, reason=response.reason, body=first)
            copy_response_headers(response.headers, whole.headers, up.name, ex.attempts)
            # Sent here, not after the handler returns, so the request's duration
            # and a client leaving during the write are seen by this request.
            await whole.prepare(request)
            await whole.write_eof()
            return whole
        resp = web.StreamResponse(status=response.status, reason=response.reason)
        copy_response_headers(response.headers, resp.headers, up.name, ex.attempts)
        await resp.prepare(request)
        # Each chunk goes straight to the writer `prepare` set up (the response's own,
        # framing included): no `StreamResponse.write` frame and checks per chunk.
        write = request.writer.write
        if first:
            await write(first)
        ex.start(IDLE, up.idle_s)
        try:
            while chunk := await content.readany():
                await write(chunk)
                ex.touch()
        except asyncio.CancelledError:
            if ex.expired() is None:
                raise
            return _abort(request, resp, up, "idle_timeout")
        except (aiohttp.ClientError, OSError) as exc:
            if isinstance(exc, ConnectionResetError) and request.transport is None:
                return resp  # the client went away
            return _abort(request, resp, up, type(exc).__name__)
        ex.stop_phase()
        complete = True
        await resp.write_eof()
        return resp
    finally:
        # A body not read to its end leaves the connection unusable: close it.
        if complete:
            response.release()
        else:
            response.close()


def _abort(
    request: web.BaseRequest, resp: web.StreamResponse, up: Upstream, reason: str
) -> web.StreamResponse:
    """Cut the client connection mid-stream: never a clean end of a truncated body."""
    logs.event("stream_aborted", upstream=up.name, reason=reason)
    if request.transport is not None:
        request.transport.abort()
    return resp

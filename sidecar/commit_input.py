"""Reading an answer up to its commit point: the bytes the judge step judges.

:func:`read_commit_input` is called by the request path once an attempt's status
and headers are in, while the attempt's first-byte deadline runs (contract,
"The commit point": ``first_byte_timeout_ms`` runs to the first output). What it
reads depends on the answer:

- a 2xx ``text/event-stream`` (:func:`~sidecar.sse_hold.holds_events`): chunks
  are fed to :class:`~sidecar.sse_hold.SseHold` until it decides (first output
  event, error event, more than 64 KiB, end of stream); nothing goes to the
  client meanwhile, and the held bytes come back whole, to be written in one write;
- a 2xx JSON answer (``application/json``, not compressed): the whole body up to
  256 KiB (:data:`~sidecar.turn.JSON_TURN_LIMIT_BYTES`), parsed once for its usage
  (:class:`~sidecar.usage.Usage`) and judged as a turn (:func:`~sidecar.turn.json_turn`:
  an empty turn is ``EMPTY``); ``first_byte_timeout_ms`` ends at its first chunk and
  ``idle_timeout_ms`` bounds each wait for the rest (contract, "An empty turn is a
  failure"); a longer body is not judged;
- a 400/413 when the route has ``context_window_fallback``: the body up to its
  first 64 KiB (or its end), for the context-window markers;
- a status in ``retry.statuses``: nothing (None): its body is read only if it
  is the answer relayed;
- anything else: the first body chunk.

An event stream's held bytes are read for usage here too; after the commit the
relay pumps the rest of the body itself, feeding a stream's chunks to the same
:class:`~sidecar.usage.Usage` (its one byte search per chunk).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
import orjson

from sidecar.exchange import FIRST_BYTE, IDLE, Exchange
from sidecar.judge import CONTEXT_WINDOW_SCAN_BYTES, CONTEXT_WINDOW_STATUSES
from sidecar.outcome import FIRST_BYTE_DETAIL, UpstreamTimeout
from sidecar.sse_hold import HOLD, RATE_LIMIT_ERROR_TYPES, SseHold
from sidecar.sse_hold import Verdict as Said
from sidecar.turn import JSON_TURN_LIMIT_BYTES, Turn, json_turn
from sidecar.upstream import failure, first_output
from sidecar.usage import Usage

__all__ = ["CommitInput", "read_commit_input", "read_deferred_first"]

CommitInput = tuple[bytes | None, Said | None, Usage | None]
"""(bytes read, the verdict of a judged 2xx, the answer's usage so far)."""


async def read_commit_input(
    response: aiohttp.ClientResponse,
    retry_statuses: frozenset[int],
    context_window_fallback: bool,
    ex: Exchange,
    idle_s: float,
) -> CommitInput:
    """The commit point's input of ``response``.

    :param ex: the request's exchange (a JSON body's rest is read under ``IDLE``;
        :attr:`~sidecar.exchange.Exchange.output_at` is set when that body took more
        than one chunk, so its first output is timed at its first chunk).
    :param idle_s: the upstream's ``idle_timeout_ms`` in seconds.
    :returns: the bytes read (``b""``: an empty body; None: not read, a status in
        ``retry_statuses``); for a held event stream the
        :class:`~sidecar.sse_hold.Verdict` of its first deciding event (a provider's
        error event of a rate-limit type: ``RATE_LIMIT_ERROR``), for a judged
        JSON answer ``EMPTY`` when it is an empty turn (None for any other answer);
        and the answer's :class:`~sidecar.usage.Usage` for an event stream or a
        judged JSON answer (None otherwise).
    :raises UpstreamError: the body broke before the commit point.
    """
    status = response.status
    if 200 <= status < 300:
        media = _readable_media(response.headers)
        if media == "text/event-stream":  # as sidecar.sse_hold.holds_events says
            return await _held_events(response)
        if media == "application/json":
            return await _json_turn(response, ex, idle_s)
    if context_window_fallback and status in CONTEXT_WINDOW_STATUSES:
        return await _body_head(response), None, None
    if status in retry_statuses:
        return None, None, None
    return await first_output(response), None, None


def _readable_media(headers: Mapping[str, str]) -> str:
    """The ``Content-Type``'s media type in lower case (parameters dropped), or ``""``
    for a compressed body (a ``Content-Encoding`` other than ``identity``): relayed
    untouched and never read (:func:`sidecar.sse_hold.holds_events` says the same of
    streams)."""
    encoding = headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        return ""
    return headers.get("Content-Type", "").split(";", 1)[0].strip().lower()


async def read_deferred_first(
    response: aiohttp.ClientResponse, ex: Exchange, first_byte_s: float
) -> bytes:
    """The first body chunk of an answer whose status is in ``retry.statuses``, once it
    is the answer to relay (:func:`read_commit_input` left it unread: a retried
    answer's body is never read). Read under ``first_byte_timeout_ms``.

    :param first_byte_s: the upstream's ``first_byte_timeout_ms`` in seconds.
    :returns: the chunk (``b""``: an empty body).
    :raises UpstreamError: the body broke, or :class:`~sidecar.outcome.UpstreamTimeout`
        when no chunk came in time (the sidecar then answers 502 or 504).
    """
    ex.start(FIRST_BYTE, first_byte_s)
    try:
        first = await first_output(response)
    except asyncio.CancelledError:
        if ex.expired() is None:
            raise
        raise UpstreamTimeout(FIRST_BYTE_DETAIL) from None
    ex.stop_phase()
    return first


async def _held_events(response: aiohttp.ClientResponse) -> CommitInput:
    hold = SseHold()
    content = response.content
    try:
        while True:
            chunk = await content.readany()
            decision = hold.feed(chunk) if chunk else hold.finish()
            if decision is not HOLD:
                usage = Usage()
                usage.feed(decision.data)
                said = decision.verdict
                if said is Said.PROVIDER_ERROR and decision.reason in RATE_LIMIT_ERROR_TYPES:
                    said = Said.RATE_LIMIT_ERROR
                return decision.data, said, usage
    except (aiohttp.ClientError, OSError) as exc:
        raise failure(exc) from None


async def _json_turn(response: aiohttp.ClientResponse, ex: Exchange, idle_s: float) -> CommitInput:
    """A 2xx JSON body, whole up to :data:`JSON_TURN_LIMIT_BYTES`: its usage and turn."""
    content = response.content
    try:  # first_output's read, inline: one coroutine frame less per JSON answer
        body = await content.readany()
    except (aiohttp.ClientError, OSError) as exc:
        raise failure(exc) from None
    if body and not content.at_eof():
        ex.output_at = ex.clock.now()
        ex.stop_phase()
        ex.start(IDLE, idle_s)
        parts = [body]
        size = len(body)
        try:
            while size <= JSON_TURN_LIMIT_BYTES and (chunk := await content.readany()):
                parts.append(chunk)
                size += len(chunk)
                ex.touch()
        except (aiohttp.ClientError, OSError) as exc:
            raise failure(exc) from None
        body = b"".join(parts)
        if size > JSON_TURN_LIMIT_BYTES or not content.at_eof():
            return body, None, None  # too long to judge: relayed as it comes
    if not body:
        return body, None, None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body, None, None
    usage = Usage()
    usage.take(doc)
    return body, Said.EMPTY if json_turn(doc) is Turn.EMPTY else None, usage


async def _body_head(response: aiohttp.ClientResponse) -> bytes:
    """The body's first :data:`CONTEXT_WINDOW_SCAN_BYTES` (all of it when shorter)."""
    head = await first_output(response)
    if not head:
        return head
    parts = [head]
    size = len(head)
    content = response.content
    try:
        while size < CONTEXT_WINDOW_SCAN_BYTES and (chunk := await content.readany()):
            parts.append(chunk)
            size += len(chunk)
    except (aiohttp.ClientError, OSError) as exc:
        raise failure(exc) from None
    return b"".join(parts)

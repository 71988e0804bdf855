"""Reading an answer up to its commit point: the bytes the judge step judges.

:func:`read_commit_input` is called by the request path once an attempt's status
and headers are in, while the attempt's first-byte deadline runs (contract,
"The commit point": ``first_byte_timeout_ms`` runs to the first output). What it
reads depends on the answer:

- a 2xx ``text/event-stream`` (:func:`~sidecar.sse_hold.holds_events`): chunks
  are fed to :class:`~sidecar.sse_hold.SseHold` until it decides (first output
  event, error event, more than 64 KiB, end of stream); nothing goes to the
  client meanwhile, and the held bytes come back whole, to be written in one write;
- a 400/413 when the route has ``context_window_fallback``: the body up to its
  first 64 KiB (or its end), for the context-window markers;
- a status in ``retry.statuses``: nothing (None): its body is read only if it
  is the answer relayed;
- anything else: the first body chunk.

After the commit the relay pumps the rest of the body itself: this module does
no per-chunk work past the commit point.
"""

from __future__ import annotations

import aiohttp

from sidecar.judge import CONTEXT_WINDOW_SCAN_BYTES, CONTEXT_WINDOW_STATUSES
from sidecar.outcome import UpstreamResetError
from sidecar.sse_hold import HOLD, SseHold, holds_events
from sidecar.sse_hold import Verdict as Said
from sidecar.upstream import first_output, translate

__all__ = ["read_commit_input"]


async def read_commit_input(
    response: aiohttp.ClientResponse,
    retry_statuses: frozenset[int],
    context_window_fallback: bool,
) -> tuple[bytes | None, Said | None]:
    """The commit point's input of ``response``: (bytes read, the stream's verdict).

    :returns: the bytes read (``b""``: an empty body; None: not read, a status in
        ``retry_statuses``), and for a held event stream the
        :class:`~sidecar.sse_hold.Verdict` of its first deciding event (None for
        any other answer).
    :raises UpstreamError: the body broke before the commit point.
    """
    status = response.status
    if holds_events(status, response.headers):
        return await _held_events(response)
    if context_window_fallback and status in CONTEXT_WINDOW_STATUSES:
        return await _body_head(response), None
    if status in retry_statuses:
        return None, None
    return await first_output(response), None


async def _held_events(response: aiohttp.ClientResponse) -> tuple[bytes, Said]:
    hold = SseHold()
    content = response.content
    try:
        while True:
            chunk = await content.readany()
            decision = hold.feed(chunk) if chunk else hold.finish()
            if decision is not HOLD:
                return decision.data, decision.verdict
    except (aiohttp.ClientError, OSError) as exc:
        raise translate(exc) or UpstreamResetError(type(exc).__name__) from None


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
        raise translate(exc) or UpstreamResetError(type(exc).__name__) from None
    return b"".join(parts)

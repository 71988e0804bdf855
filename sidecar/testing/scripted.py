"""Scripted upstream answers without sockets, for unit tests of the retry and fallback loop.

aioresponses patches ``aiohttp.ClientSession`` so that each request gets the next
scripted answer (a status, headers and body, or an exception: connect errors,
resets, timeouts). :func:`scripted_upstreams` is ``aioresponses()`` with the
response class below as its default: aioresponses 0.7 builds
:class:`aiohttp.ClientResponse` without the ``stream_writer`` that aiohttp 3.14
requires. aioresponses patches ``ClientSession._request``, which the sidecar's
send path skips (:mod:`sidecar.wire.upstream_call`): while it is active, the upstream
calls go through ``session._request`` again, so that they reach the script.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import aiohttp
from aioresponses import aioresponses
from yarl import URL

__all__ = ["ScriptedResponse", "scripted_upstreams", "through_session"]


class _SentRequest:
    """The request writer of an answer that never went over a socket."""

    output_size = 0


class ScriptedResponse(aiohttp.ClientResponse):
    """:class:`aiohttp.ClientResponse` as aioresponses builds it, on aiohttp 3.14 too."""

    def __init__(self, method: str, url: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stream_writer", _SentRequest())
        super().__init__(method, url, **kwargs)


async def through_session(
    session: aiohttp.ClientSession,
    method: str,
    url: URL,
    headers: list[tuple[str, str]],
    data: bytes | None,
    watcher: object = None,
) -> aiohttp.ClientResponse:
    """:func:`sidecar.wire.upstream_call.call` by way of ``session._request`` (patched by
    aioresponses); the pool watcher is not told anything."""
    return await session._request(method, url, headers=headers, data=data, allow_redirects=False)


class scripted_upstreams(aioresponses):
    """``with scripted_upstreams() as m: m.post(url, status=503)`` (see aioresponses)."""

    def start(self) -> None:
        super().start()
        self._send_patch = mock.patch("sidecar.upstream.call", through_session)
        self._send_patch.start()

    def stop(self) -> None:
        self._send_patch.stop()
        super().stop()

    def add(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("response_class", ScriptedResponse)
        super().add(*args, **kwargs)

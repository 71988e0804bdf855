"""Scripted upstream answers without sockets, for unit tests of the retry and fallback loop.

aioresponses patches ``aiohttp.ClientSession`` so that each request gets the next
scripted answer (a status, headers and body, or an exception: connect errors,
resets, timeouts). :func:`scripted_upstreams` is ``aioresponses()`` with the
response class below as its default: aioresponses 0.7 builds
:class:`aiohttp.ClientResponse` without the ``stream_writer`` that aiohttp 3.14
requires.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aioresponses import aioresponses

__all__ = ["ScriptedResponse", "scripted_upstreams"]


class _SentRequest:
    """The request writer of an answer that never went over a socket."""

    output_size = 0


class ScriptedResponse(aiohttp.ClientResponse):
    """:class:`aiohttp.ClientResponse` as aioresponses builds it, on aiohttp 3.14 too."""

    def __init__(self, method: str, url: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stream_writer", _SentRequest())
        super().__init__(method, url, **kwargs)


class scripted_upstreams(aioresponses):
    """``with scripted_upstreams() as m: m.post(url, status=503)`` (see aioresponses)."""

    def add(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("response_class", ScriptedResponse)
        super().add(*args, **kwargs)

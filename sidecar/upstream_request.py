"""The upstream request class: aiohttp's ``ClientRequest`` without two per-request rebuilds.

aiohttp builds each request's headers three times and its skip-set once per
request (py-spy, JSON c=64: ``update_auto_headers`` alone ~10 us of ~290):

* ``ClientSession._prepare_headers`` turns the pairs into a fresh ``CIMultiDict``
  (the request's own: nothing else holds it), then ``ClientRequest.update_headers``
  copies it into another one, ``Host`` first, name by name;
* ``ClientRequest.update_auto_headers`` sorts the session's ``skip_auto_headers``
  into a new ``CIMultiDict`` and copies the headers once more, to find that every
  default header (``Accept``, ``Accept-Encoding``, ``User-Agent``) is skipped.

:class:`UpstreamRequest` does the same with one C-level ``extend`` and a skip map
built once. What goes on the wire is byte for byte what aiohttp's own class
sends for the sidecar's session (``tests/unit/test_upstream_request.py``
compares the two). It is only for sessions made with ``skip_auto_headers=``
:data:`SKIP_AUTO_HEADERS` (every default header skipped); headers that carry
their own ``Host`` (a configured ``headers.Host``) take aiohttp's own path.
"""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp
from aiohttp import hdrs
from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy

SKIP_AUTO_HEADERS = frozenset({"Accept", "Accept-Encoding", "User-Agent", "Content-Type"})
"""Headers aiohttp must not add (``ClientSession(skip_auto_headers=...)``): a relay
sends what the client sent."""

_SKIP: CIMultiDict[None] = CIMultiDict((h, None) for h in sorted(SKIP_AUTO_HEADERS))
"""aiohttp's per-request skip map, built once; read only (by ``update_body_from_data``)."""

assert all(h in _SKIP for h in aiohttp.ClientRequest.DEFAULT_HEADERS)


class UpstreamRequest(aiohttp.ClientRequest):
    """:class:`aiohttp.ClientRequest` for the sidecar's upstream sessions (``request_class``)."""

    def update_headers(self, headers: object) -> None:
        if (
            not isinstance(headers, CIMultiDict | CIMultiDictProxy | MultiDict | MultiDictProxy)
            or hdrs.HOST in headers
        ):
            super().update_headers(headers)  # type: ignore[arg-type]
            return
        host = self.url.host_port_subcomponent
        assert host is not None
        self.headers = CIMultiDict(((hdrs.HOST, host),))
        self.headers.extend(headers)

    def update_auto_headers(self, skip_auto_headers: Iterable[str] | None) -> None:
        # The session's skip set is SKIP_AUTO_HEADERS: aiohttp would add nothing.
        self._skip_auto_headers = _SKIP

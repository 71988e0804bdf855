"""The upstream request class: aiohttp's ``ClientRequest`` without two per-request rebuilds,
and (Python 3.11) without a task to write a small body (:meth:`UpstreamRequest.send`).

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

import sys
from collections.abc import Iterable

import aiohttp
from aiohttp import hdrs
from aiohttp.connector import Connection
from aiohttp.http import HttpVersion10, HttpVersion11, StreamWriter
from aiohttp.payload import BytesPayload
from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy
from yarl import URL

from sidecar.wire.whole_answer import keep_raw_head

SKIP_AUTO_HEADERS = frozenset({"Accept", "Accept-Encoding", "User-Agent", "Content-Type"})
"""Headers aiohttp must not add (``ClientSession(skip_auto_headers=...)``): a relay
sends what the client sent."""

_SKIP: CIMultiDict[None] = CIMultiDict((h, None) for h in sorted(SKIP_AUTO_HEADERS))
"""aiohttp's per-request skip map, built once; read only (by ``update_body_from_data``)."""

assert all(h in _SKIP for h in aiohttp.ClientRequest.DEFAULT_HEADERS)

INLINE_BODY_MAX = 0x8000
"""Largest body (bytes) :meth:`UpstreamRequest.send` writes inline, without a task:
half of asyncio's write high-water mark (64 KiB), so the write never waits."""

_EAGER_TASKS = sys.version_info >= (3, 12)
"""aiohttp starts its body-writer task eagerly on Python 3.12+: nothing to save there."""


class UpstreamRequest(aiohttp.ClientRequest):
    """:class:`aiohttp.ClientRequest` for the sidecar's upstream sessions (``request_class``)."""

    raw_head = False
    """The head holds octets outside ASCII (the client's obs-text, kept by aiohttp's parser
    as surrogate escapes): :meth:`send` writes them as they came
    (:func:`sidecar.wire.whole_answer.raw_head`; RFC 9110 section 5.5), where aiohttp's
    writer drops them. Set by :func:`sidecar.wire.upstream_call.call` on that rare path."""

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

    async def send(self, conn: Connection) -> aiohttp.ClientResponse:
        """Write the request (head and body in one write) and return its response object.

        On Python 3.11 ``ClientRequest.send`` writes every body from a new task
        (``write_bytes``), which runs one event-loop iteration later: a task, a
        loop turn and an ``epoll_wait`` per request with a body. On 3.12+ aiohttp
        starts that task eagerly, and a small body is written before ``send``
        returns. This does what the eager path does, on 3.11: for a bytes body of
        at most :data:`INLINE_BODY_MAX` bytes, on a connection not paused for
        writing, ``write_bytes`` is awaited inline (it cannot wait: the write is
        below the transport's high-water mark), and the response gets no writer
        task, as aiohttp's own does when the eager task ends at once. Its errors are
        aiohttp's: ``write_bytes`` sets them on the protocol, and
        ``ClientResponse.start`` raises them. Anything else (a larger or streamed
        body, ``Expect: 100-continue``, a proxy, compression, chunking, tracing,
        an upload tracker, Python 3.12+) takes aiohttp's own ``send``, but for a head
        with obs-text (:attr:`raw_head`, rare), written here whatever the body's size or
        the Python version (aiohttp's ``send`` gives no way to change the head's bytes;
        a large body is then written before the response is read, not alongside).
        ``tests/unit/test_upstream_request.py`` checks the bytes on the wire are
        aiohttp's.
        """
        body = self._body
        protocol = conn.protocol
        raw = self.raw_head
        if (
            (_EAGER_TASKS and not raw)
            or not (isinstance(body, BytesPayload) or (raw and body is None))
            or (body is not None and (body.size or 0) > INLINE_BODY_MAX and not raw)
            or protocol is None
            or protocol.writing_paused
            or self._continue is not None
            or self.method == hdrs.METH_CONNECT
            or self.proxy is not None
            or self.compress
            or self.chunked is not None
            or self._traces
            or self._upload_tracker is not None
        ):
            return await super().send(conn)
        # What ClientRequest.send does before it writes, for this case. The
        # default Content-Type is never added: the session skips it.
        v = self.version
        if hdrs.CONNECTION not in self.headers:
            if conn._connector.force_close:
                if v == HttpVersion11:
                    self.headers[hdrs.CONNECTION] = "close"
            elif v == HttpVersion10:
                self.headers[hdrs.CONNECTION] = "keep-alive"
        writer = StreamWriter(protocol, self.loop)
        status_line = f"{self.method} {self.url.raw_path_qs} HTTP/{v.major}.{v.minor}"
        await writer.write_headers(status_line, self.headers)
        if raw:
            keep_raw_head(writer, status_line, self.headers)
        await self.write_bytes(writer, conn, self._get_content_length())
        response_class = self.response_class
        assert response_class is not None
        response = response_class(
            self.method,
            self.original_url,
            writer=None,
            continue100=None,
            timer=self._timer,
            request_info=self.request_info,
            traces=self._traces,
            loop=self.loop,
            session=self._session,
            stream_writer=writer,
        )
        self.response = response  # type: ignore[assignment]  # aiohttp declares it None
        return response


def proxied_request_class(proxy: URL, authorization: str | None) -> type[UpstreamRequest]:
    """An :class:`UpstreamRequest` class whose requests all go through the egress proxy
    ``proxy`` (``http://host:port``), for the session of an upstream that has one
    (:mod:`sidecar.egress`). ``authorization``: the ``Proxy-Authorization`` value to send
    the proxy (on the ``CONNECT``; on each request to an ``http`` upstream), or None.

    aiohttp's connector does the rest, as for ``ClientSession(proxy=...)``: for an
    ``https`` upstream a ``CONNECT`` tunnel then TLS to the upstream through it
    (``TCPConnector._create_proxy_connection``, with the proxy headers), for an ``http``
    one the request in absolute form to the proxy (``ClientRequest.send``); the pool keys
    connections by proxy. Requests of an upstream without a proxy never see this class:
    no cost there.
    """
    headers = None if authorization is None else {hdrs.PROXY_AUTHORIZATION: authorization}

    class ProxiedRequest(UpstreamRequest):
        def update_proxy(
            self,
            proxy_: URL | None,
            proxy_auth: aiohttp.BasicAuth | None,
            proxy_headers: object,
        ) -> None:
            super().update_proxy(proxy, None, headers)
            if authorization is not None and not self.is_ssl():
                # No CONNECT: the proxy reads it on the request itself.
                self.headers[hdrs.PROXY_AUTHORIZATION] = authorization

    return ProxiedRequest

"""One upstream HTTP exchange on aiohttp's client objects, without ``ClientSession._request``.

``ClientSession._request`` is aiohttp's general path: about 540 lines per call for
what a relay never uses (cookies, auth and netrc, proxies from the environment,
redirects, tracing, middlewares, a total timeout, upload trackers) and one thing
the contract wants done differently (it resends an idempotent request once after
any connection failure; the contract resends any request once, only after a
reused keep-alive connection failed: :func:`sidecar.upstream.send`). Under
callgrind its own work was about 5% of a proxied JSON request.

:func:`call` keeps every part that does HTTP, all aiohttp's own: the request is
an :class:`aiohttp.ClientRequest` (the session's ``request_class``, headers and
body framing), the connection comes from the session's connector (its pool and
connect timeout), the response parser gets the session's limits
(``ResponseHandler.set_response_params``), and ``ClientRequest.send`` /
``ClientResponse.start`` write the request and read the status line and headers.
``tests/unit/test_upstream_call.py`` pins the aiohttp signatures used here and that
the bytes on the wire and the errors raised are those of ``session._request``,
but one: a connection of the sidecar's pool that breaks after part of the response
head raises :class:`ResponseCutError` (so it is not resent as a dead keep-alive
connection; ``tests/e2e/test_resend_once.py``).
"""

from __future__ import annotations

import io
from typing import Protocol

import aiohttp
from aiohttp.helpers import TimerNoop
from aiohttp.payload import TOO_LARGE_BYTES_BODY
from multidict import CIMultiDict
from yarl import URL

from sidecar.wire.pool import PoolWatcher, UpstreamProtocol, Watched

__all__ = ["RawHeadWatcher", "ResponseCutError", "UpstreamResponse", "call"]


class UpstreamResponse(aiohttp.ClientResponse):
    """The sidecar's upstream responses (the session's ``response_class``): aiohttp's, plus
    :attr:`raw_head`."""

    raw_head = False
    """The head holds octets outside ASCII (set by :func:`sidecar.upstream.check_header_fields`
    on that rare path): relayed with :func:`sidecar.wire.whole_answer.raw_head`, whose
    obs-text aiohttp's writer would drop (RFC 9110 section 5.5)."""


class RawHeadWatcher(PoolWatcher, Protocol):
    """A :class:`PoolWatcher` that also says whether the request's head holds octets
    outside ASCII (:attr:`raw_head`: written as they came, :class:`UpstreamRequest`)."""

    raw_head: bool


class ResponseCutError(aiohttp.ClientError):
    """The connection broke after some bytes of the response head had arrived.

    Raised instead of aiohttp's ``ServerDisconnectedError`` / ``ClientOSError`` then, so
    that the request is not resent as one that failed before any response byte (the
    upstream saw it and began to answer: contract, resend-once rule). Only on
    connections of a :class:`sidecar.wire.pool.PoolConnector`.
    """


_NO_TIMER = TimerNoop()
"""aiohttp's do-nothing timer: no total timeout (the sidecar's deadlines are its own)."""
_HEAD = "HEAD"


async def call(
    session: aiohttp.ClientSession,
    method: str,
    url: URL,
    headers: list[tuple[str, str]],
    data: bytes | None,
    watcher: RawHeadWatcher | None = None,
) -> aiohttp.ClientResponse:
    """Send one request on ``session`` and return its response once status and headers are in.

    The session must be the sidecar's (:meth:`sidecar.upstream.Upstream.start`): no
    cookie jar in use, no redirects followed, no total timeout, bodies not decompressed.

    :param method: the request method, as received (upper case).
    :param url: the absolute upstream URL (``encoded=True``).
    :param headers: the request's header pairs, in order (no ``Host``: aiohttp adds it).
    :param data: the body, or None for none. Over aiohttp's ``TOO_LARGE_BYTES_BODY``
        (1 MiB) it is sent from an :class:`io.BytesIO` (no copy: it shares the bytes),
        written 64 KiB at a time with the event loop's turn between writes, as aiohttp
        asks (it warns, ``ResourceWarning``, of a larger ``bytes`` body written at once);
        the same bytes and ``Content-Length`` on the wire either way.
    :param watcher: told by the pool whether the connection was reused and while the
        request waits for a free one (:class:`~sidecar.wire.pool.PoolConnector`); its
        ``raw_head`` says the head is to be written with its obs-text octets.
    :returns: the response; the caller releases or closes it.
    :raises aiohttp.ConnectionTimeoutError: ``connect_timeout_ms`` ran out.
    :raises aiohttp.ClientConnectorError: the connection could not be made.
    :raises aiohttp.ClientOSError: a socket error while sending or reading the head.
    :raises ResponseCutError: the connection broke after part of the response head.
    :raises aiohttp.ClientError: any other failure aiohttp reports (a disconnect, a
        malformed response head).
    """
    connector = session.connector
    assert connector is not None
    req = session._request_class(
        method,
        url,
        headers=CIMultiDict(headers),
        skip_auto_headers=session.skip_auto_headers,
        data=data if data is None or len(data) <= TOO_LARGE_BYTES_BODY else io.BytesIO(data),
        loop=session._loop,
        response_class=session._response_class,
        timer=_NO_TIMER,
        session=session,
    )
    if watcher is not None and watcher.raw_head:
        req.raw_head = True  # type: ignore[attr-defined]  # UpstreamRequest
    try:
        traces = [] if watcher is None else Watched(watcher)
        conn = await connector.connect(req, traces=traces, timeout=session.timeout)
    except TimeoutError as exc:
        raise aiohttp.ConnectionTimeoutError(f"Connection timeout to host {url}") from exc
    protocol = conn.protocol
    assert protocol is not None
    if isinstance(protocol, UpstreamProtocol):
        protocol.received = False
        protocol.session = session
    protocol.set_response_params(
        timer=_NO_TIMER,
        skip_payload=method == _HEAD,
        read_until_eof=True,
        auto_decompress=False,
        read_timeout=None,
        read_bufsize=session._read_bufsize,
        timeout_ceil_threshold=connector._timeout_ceil_threshold,
        max_line_size=session._max_line_size,
        max_field_size=session._max_field_size,
        max_headers=session._max_headers,
    )
    try:
        resp = await req.send(conn)
        try:
            await resp.start(conn)
        except BaseException:
            resp.close()
            raise
    except BaseException as exc:
        conn.close()
        if (
            isinstance(exc, aiohttp.ServerDisconnectedError | OSError)
            and not isinstance(exc, TimeoutError)
            and isinstance(protocol, UpstreamProtocol)
            and protocol.received
        ):
            raise ResponseCutError(f"connection lost during the response head: {exc!r}") from exc
        if isinstance(exc, OSError) and not isinstance(exc, aiohttp.ClientError):
            if exc.errno is None and isinstance(exc, TimeoutError):
                raise
            raise aiohttp.ClientOSError(*exc.args) from exc
        raise
    return resp

"""One upstream: its aiohttp client session, and one attempt sent on it.

:class:`Upstream` holds one configured provider's client session (its own pool of
``max_connections``), base URL, auth, retry settings and backoff schedule.
:func:`send` sends one attempt and returns the status and headers;
:func:`first_output` waits for the first body chunk (the commit point's input).
Both raise only :mod:`sidecar.outcome`'s errors for upstream failures, and so does
every read before the commit point (:mod:`sidecar.commit_input`, through
:func:`failure`): :func:`translate` is the one mapping of aiohttp's exceptions (after
the commit point the relay treats any of them as a cut)::

    aiohttp.ConnectionTimeoutError, ClientConnectorError,
    ClientHttpProxyError (the egress proxy refused)       -> UpstreamConnectError
    aiohttp.ServerTimeoutError                            -> UpstreamTimeout
    any other aiohttp.ClientError, ConnectionError, OSError -> UpstreamResetError

The retry loop is the proxy's (:mod:`sidecar.proxy`); aiohttp-retry supplies only
its backoff schedule (:meth:`Upstream.backoff_s`, from ``ExponentialRetry``), which
``retry.jitter`` turns into full jitter with the generation's random source
(:meth:`Upstream.retry_wait`); :attr:`Upstream.budget` is the upstream's retry budget
(:mod:`sidecar.retry_budget`).

aiohttp pitfalls handled here: redirects are not followed
(``allow_redirects=False``), bodies are not decompressed (``auto_decompress=False``),
no ``Accept-Encoding``/``User-Agent`` is added, and no total timeout cuts long streams.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from itertools import chain
from random import random

import aiohttp
from aiohttp import hdrs
from aiohttp_retry import ExponentialRetry
from yarl import URL

from sidecar import logs
from sidecar.causes import classify
from sidecar.clock import Clock
from sidecar.config import UpstreamConfig
from sidecar.egress import client_ssl, proxy_for
from sidecar.exchange import Exchange
from sidecar.headers import request_header_pairs, request_header_rule
from sidecar.outcome import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamResetError,
    UpstreamTimeout,
)
from sidecar.retry_after import parse_retry_after
from sidecar.retry_budget import RetryBudget
from sidecar.target import only_chunked
from sidecar.wire import (
    SKIP_AUTO_HEADERS,
    PoolConnector,
    UpstreamRequest,
    UpstreamResponse,
    call,
    proxied_request_class,
)

_URL_CACHE_SIZE = 1024

_FORBIDDEN_HEADER_BYTES = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
"""What aiohttp's server refuses to send in a header (RFC 9110 s. 5.5) although its
client parser accepts it in a response. Tab (allowed) joins the fields for one search."""
_UNUSUAL_HEADER_BYTES = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f-\xff]")
"""The forbidden bytes and those outside ASCII: one search finds both (the second kind
is looked for apart only when it matches)."""


def check_header_fields(response: UpstreamResponse) -> None:
    """An answer whose head could not be relayed as it means is a broken response.

    :raises UpstreamResetError: a header name or value holds a control character (RFC
        9110 section 5.5); the status is ``101 Switching Protocols``, which the sidecar
        never asks for (it sends no ``Upgrade``; RFC 9110 section 15.2.2: a server MUST
        NOT switch to a protocol the client did not ask for); the body is framed with a
        ``Transfer-Encoding`` other than ``chunked`` alone (``gzip, chunked``: aiohttp
        removes the chunked coding only, and a transfer coding is hop-by-hop, RFC 9112
        sections 6.1 and 7, so the client would get coded bytes labelled plain; nginx
        and Envoy answer 502).

    A head with octets outside ASCII (and no control character) is marked
    :attr:`~sidecar.wire.UpstreamResponse.raw_head`, for the relay to write them back.
    """
    fields = b"\t".join(chain.from_iterable(response.raw_headers))
    if _UNUSUAL_HEADER_BYTES.search(fields):
        if _FORBIDDEN_HEADER_BYTES.search(fields):
            raise UpstreamResetError("invalid response header (RFC 9110 section 5.5)")
        response.raw_head = True  # obs-text or UTF-8: relayed as it came (RFC 9110 5.5)
    if response.status == 101:
        raise UpstreamResetError("unsolicited 101")
    headers = response.headers
    te = headers.get(hdrs.TRANSFER_ENCODING)
    if (
        te is not None
        and te != "chunked"
        and not only_chunked(headers.getall(hdrs.TRANSFER_ENCODING))
    ):
        raise UpstreamResetError("unknown transfer coding")


_CONNECT_ERRORS = (
    aiohttp.ConnectionTimeoutError,
    aiohttp.ClientConnectorError,
    aiohttp.ClientHttpProxyError,
)


def translate(exc: BaseException, proxied: bool = False) -> UpstreamError | None:
    """Map an aiohttp/OS exception raised before the commit point to our tree.

    :param proxied: the attempt went through an egress proxy (a connect failure is then
        the proxy's: :func:`sidecar.causes.classify`).
    :returns: the translated error, with its cause and detail for the logs
        (:func:`sidecar.causes.classify`), or None for exceptions that are not
        upstream failures (they propagate unchanged: cancellation, bugs).

    Order matters: :class:`aiohttp.ClientConnectorError` is a subclass of
    :class:`aiohttp.ClientOSError`, and a connect timeout
    (:class:`aiohttp.ConnectionTimeoutError`) is a connect failure (contract), and so
    is an egress proxy that refuses the ``CONNECT`` (:class:`aiohttp.ClientHttpProxyError`,
    contract, "Configuration").
    """
    if isinstance(exc, UpstreamError):  # already ours (see check_header_fields)
        return exc
    if isinstance(exc, _CONNECT_ERRORS):
        return UpstreamConnectError(*_detail_cause(exc, proxied))
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return UpstreamTimeout(*_detail_cause(exc, proxied))
    if isinstance(exc, aiohttp.ClientError | ConnectionError | OSError):
        return UpstreamResetError(*_detail_cause(exc, proxied))
    return None


def _detail_cause(exc: BaseException, proxied: bool) -> tuple[str, str]:
    cause, detail = classify(exc, proxied)
    return detail, cause


def failure(exc: aiohttp.ClientError | OSError, proxied: bool = False) -> UpstreamError:
    """The :class:`~sidecar.outcome.UpstreamError` of an aiohttp or OS error raised while
    sending or reading before the commit point (:func:`translate`'s mapping)."""
    return translate(exc, proxied) or UpstreamResetError(*_detail_cause(exc, proxied))


class Upstream:
    """One configured upstream: its client session, base URL, auth and retry settings.

    :param name: the config name (``upstreams.<name>``).
    :param config: its :class:`~sidecar.config.UpstreamConfig`.
    :param api_key: the value of ``api_key_env`` (None: pass client auth through).
    :param environ: where the egress proxy variables are read (``HTTPS_PROXY``,
        ``HTTP_PROXY``, ``NO_PROXY``: :mod:`sidecar.egress`); None: no proxy.
    :param draw: a draw in [0, 1) for the backoff's jitter (the generation's seeded
        random source in tests); default :func:`random.random`.
    :raises ValueError: the proxy variable that applies holds an unusable URL
        (``sidecar serve`` reports it before: :func:`sidecar.egress.problems`).
    """

    def __init__(
        self,
        name: str,
        config: UpstreamConfig,
        api_key: str | None,
        environ: Mapping[str, str] | None = None,
        draw: Callable[[], float] | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.api_key = api_key
        self.base = config.base_url.rstrip("/")
        """``base_url`` without a trailing slash; request targets are appended to it."""
        self.first_byte_s = config.first_byte_timeout_s
        self.idle_s = config.idle_timeout_s
        r = config.retry
        self.max_retries = r.max_retries
        self.retry_statuses = frozenset(r.statuses)
        self.retry_on_timeout = r.retry_on_timeout
        self.retry_after_max_s = r.retry_after_max_ms / 1000
        self.jitter: Callable[[], float] | None = (draw or random) if r.jitter else None
        """The draw in [0, 1) that scales each backoff wait (``retry.jitter``), or None."""
        self.budget = RetryBudget(r.budget_percent, r.min_retry_concurrency)
        """This upstream's retry budget: its requests and retries in flight."""
        cb = config.circuit_breaker
        self.failure_statuses: frozenset[int] = (
            frozenset(cb.failure_statuses) if cb is not None else frozenset()
        )
        self.slow_call_ms = cb.slow_call_ms if cb is not None else 0
        self.empty_turn_is_failure = config.empty_turn_is_failure
        self._schedule = ExponentialRetry(
            attempts=1 + r.max_retries,
            start_timeout=r.backoff_initial_ms / 1000,
            max_timeout=r.backoff_max_ms / 1000,
            factor=2.0,
        )
        self._header_rule = request_header_rule(
            extra=config.headers, auth_header=config.auth_header, api_key=api_key
        )
        self._urls: dict[str, URL] = {}
        self.session: aiohttp.ClientSession | None = None
        self.pool: PoolConnector | None = None
        self.egress = None if environ is None else proxy_for(config.base_url, environ)
        """The egress proxy this upstream's connections go through, or None (direct)."""
        self.proxy: URL | None = None if self.egress is None else self.egress.url
        """The egress proxy's ``http://host:port`` (no credentials), or None."""

    @property
    def full(self) -> bool:
        """Whether every one of ``max_connections`` is in use (False before :meth:`start`)."""
        pool = self.pool
        return pool is not None and pool.full

    async def start(self) -> None:
        """Create the client session (one connection pool of ``max_connections``; response
        header lines and fields up to ``max_response_header_bytes``)."""
        c = self.config
        # ca_file: trusted besides the system's CAs (check-config has loaded it once).
        self.pool = PoolConnector(
            limit=c.max_connections, limit_per_host=0, ssl=client_ssl(c.ca_file)
        )
        egress = self.egress
        request_class = UpstreamRequest
        if egress is not None:
            request_class = proxied_request_class(egress.url, egress.authorization)
            logs.event(  # the proxy's host and port only, never its credentials
                "upstream_egress_proxy",
                upstream=self.name,
                proxy=f"{egress.url.host}:{egress.url.port}",
                variable=egress.variable,
            )
        self.session = aiohttp.ClientSession(
            connector=self.pool,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=c.connect_timeout_s),
            auto_decompress=False,
            skip_auto_headers=SKIP_AUTO_HEADERS,
            request_class=request_class,
            response_class=UpstreamResponse,
            # A relay keeps no cookies: aiohttp's default jar would store one client's
            # Set-Cookie and send it upstream with every other client's requests.
            cookie_jar=aiohttp.DummyCookieJar(),
            raise_for_status=False,
            # aiohttp's 8190-byte default fails healthy providers whose CDN sends a
            # long Set-Cookie or tracing header; past this it is a broken response.
            max_line_size=c.max_response_header_bytes,
            max_field_size=c.max_response_header_bytes,
        )

    async def close(self) -> None:
        """Close the session and every pooled connection."""
        if self.session is not None:
            await self.session.close()

    def url(self, path_qs: str) -> URL:
        """The upstream URL for a request path+query, appended to ``base_url`` as received
        (RFC 9112 section 3.2: the target is relayed as it came, an empty query's ``?``
        included).

        Built once per target seen (a bounded cache: clients call a few paths)."""
        url = self._urls.get(path_qs)
        if url is None:
            url = URL(self.base + path_qs, encoded=True)
            if path_qs.endswith("?"):
                # An empty query: yarl's URL drops the "?" (its raw_path_qs is the path
                # alone), and "/x?" is not "/x" (RFC 3986 section 6.2.3). A path that
                # ends in "?" keeps it in the request line (``raw_path_qs``); the
                # request target is otherwise the same.
                url = URL.build(
                    scheme=url.scheme,
                    authority=url.raw_authority,
                    path=url.raw_path + "?",
                    encoded=True,
                )
            if len(self._urls) < _URL_CACHE_SIZE:
                self._urls[path_qs] = url
        return url

    def headers(self, client_headers: Mapping[str, str]) -> list[tuple[str, str]]:
        """Headers for this upstream built from the client's (see :mod:`sidecar.headers`)."""
        return request_header_pairs(client_headers, self._header_rule)

    def backoff_s(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1, 2, ...): ``backoff_initial_ms``
        doubling up to ``backoff_max_ms`` (aiohttp-retry's ``ExponentialRetry`` schedule)."""
        return float(self._schedule.get_timeout(retry - 1))

    def answer_retry_after_s(self, response: aiohttp.ClientResponse, clock: Clock) -> float | None:
        """A 4xx/5xx answer's ``Retry-After`` in seconds (RFC 9110 section 10.2.3: delay
        seconds or an HTTP-date, read against ``clock``'s Unix time now), or None (none,
        or a 1xx-3xx: the clock is not read)."""
        if response.status < 400:
            return None
        return parse_retry_after(response.headers.get("Retry-After"), clock.wall(clock.now()))

    def capped(self, retry_after_s: float) -> float:
        """``retry_after_s`` capped at ``retry_after_max_ms``: how far one answer may extend
        an open breaker (contract, "The circuit breaker")."""
        return min(retry_after_s, self.retry_after_max_s)

    def retry_wait(
        self,
        retried: int,
        err: UpstreamError | None,
        status_retried: bool,
        retry_after_s: float | None,
    ) -> float | None:
        """Seconds to wait before the next attempt on this candidate, or None for none.

        :param retried: retries sent so far (the budget is ``max_retries``).
        :param err: the attempt's transport failure, or None for an HTTP answer.
        :param status_retried: the answer's status is in ``retry.statuses``.
        :param retry_after_s: the answer's ``Retry-After`` in seconds, if any.

        Contract: connect errors and resets are retried, a first-byte timeout only
        with ``retry_on_timeout``; a retried status waits its ``Retry-After`` when it
        has one, and one longer than ``retry_after_max_ms`` means: fall back now. With
        ``retry.jitter`` a backoff wait is drawn uniformly from [0, the backoff] ("full
        jitter", as in AWS's "Exponential Backoff And Jitter": a fleet's retries do
        not go out in lockstep); a ``Retry-After`` is the provider's and is waited as
        it came.
        """
        if retried >= self.max_retries:
            return None
        if err is not None:
            if isinstance(err, UpstreamTimeout) and not self.retry_on_timeout:
                return None
        elif not status_retried:
            return None
        elif retry_after_s is not None:
            return retry_after_s if retry_after_s <= self.retry_after_max_s else None
        backoff = self.backoff_s(retried + 1)
        jitter = self.jitter
        return backoff if jitter is None else backoff * jitter()


async def send(
    up: Upstream,
    ex: Exchange,
    method: str,
    url: URL,
    headers: list[tuple[str, str]],
    body: bytes,
) -> aiohttp.ClientResponse:
    """Send one attempt; return the response once its status and headers are in.

    The caller has started the first-byte deadline on ``ex``; the pool pauses it
    while the request waits for a free connection (``ex.queued``).

    Contract: a request that fails on a reused keep-alive connection before any
    response byte (the upstream closed an idle connection) is resent once on a
    new connection, outside the retry budget and unseen by the breaker (RFC 9112
    section 9.3.1 allows this retry; aiohttp does it only for idempotent methods).

    :raises UpstreamError: the attempt failed (see :func:`translate`).
    """
    session = up.session
    assert session is not None
    for resend in (False, True):
        ex.reused = ex.queued = False
        try:
            response = await call(session, method, url, headers, body or None, ex)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if resend or not ex.reused or isinstance(exc, aiohttp.ClientConnectorError):
                raise failure(exc, up.proxy is not None) from None
            continue
        except (aiohttp.ClientError, OSError) as exc:
            raise failure(exc, up.proxy is not None) from None
        try:
            check_header_fields(response)  # type: ignore[arg-type]  # response_class
        except UpstreamError:
            response.close()  # the connection is not reused after a broken head
            raise
        return response
    raise AssertionError("unreachable")


async def first_output(response: aiohttp.ClientResponse) -> bytes:
    """The first body chunk of ``response`` (``b""``: an empty body): the commit point's input.

    :raises UpstreamError: the body broke before its first chunk.
    """
    try:
        return await response.content.readany()
    except (aiohttp.ClientError, OSError) as exc:
        raise failure(exc) from None

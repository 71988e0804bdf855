"""Calls to one upstream: the only module that touches aiohttp's client and aiohttp-retry.

One *candidate call* = the first attempt plus up to ``retry.max_retries``
retries, all before the commit point. Each attempt sends the request and waits
for the status, headers and (for answers that are not retried) the first body
chunk, under ``first_byte_timeout_ms``. Retries and their backoff are driven by
aiohttp-retry (:class:`aiohttp_retry.RetryClient`); this module supplies:

* the per-attempt request function (:class:`_AttemptSender`): sends one
  attempt, reads the first chunk, translates aiohttp exceptions into
  :mod:`sidecar.outcome`'s tree at one boundary (:func:`translate`), and before a
  retry waits the backoff on the injected clock and asks whether the target may
  still be tried (its breaker may have opened meanwhile);
* the retry options (:class:`_CallRetryOptions`): exponential backoff from
  ``backoff_initial_ms`` to ``backoff_max_ms``, ``Retry-After`` honoured up to
  ``retry_after_max_ms``; a longer one ends the call at once ("fall back now").

aiohttp pitfalls handled here: redirects are not followed
(``allow_redirects=False``), bodies are not decompressed
(``auto_decompress=False``), no ``Accept-Encoding``/``User-Agent`` is added, no
total timeout cuts long streams, and responses that aiohttp-retry discards are
released by us (it does not release them).
"""

from __future__ import annotations

import asyncio
import contextvars
import re
from collections.abc import Iterator, Mapping
from typing import Any, cast

import aiohttp
from aiohttp_retry import ExponentialRetry, RetryClient
from multidict import CIMultiDict
from yarl import URL

from sidecar.clock import Clock
from sidecar.config import UpstreamConfig
from sidecar.headers import upstream_request_headers
from sidecar.outcome import (
    Outcome,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResetError,
    UpstreamTimeout,
    status_outcome,
)
from sidecar.retry_after import parse_retry_after

SKIP_AUTO_HEADERS = frozenset({"Accept", "Accept-Encoding", "User-Agent", "Content-Type"})

_FORBIDDEN_HEADER_BYTES = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
"""What aiohttp's server refuses to send in a header (RFC 9110 s. 5.5) although its
client parser accepts it in a response."""


def _check_header_fields(response: aiohttp.ClientResponse) -> None:
    """An answer whose headers could not be relayed is a broken response.

    :raises UpstreamResetError: a header name or value holds a control character.
    """
    for name, value in response.raw_headers:
        if _FORBIDDEN_HEADER_BYTES.search(name) or _FORBIDDEN_HEADER_BYTES.search(value):
            raise UpstreamResetError("invalid response header")


def translate(exc: BaseException) -> UpstreamError | None:
    """Map an aiohttp/OS exception raised before the commit point to our tree.

    :returns: the translated error, or None for exceptions that are not
        upstream failures (they propagate unchanged: cancellation, bugs).

    Order matters: :class:`aiohttp.ClientConnectorError` is a subclass of
    :class:`aiohttp.ClientOSError`, and a connect timeout
    (:class:`aiohttp.ConnectionTimeoutError`) is a connect failure (contract).
    """
    if isinstance(exc, UpstreamError):  # already ours (see _check_header_fields)
        return exc
    if isinstance(exc, aiohttp.ConnectionTimeoutError | aiohttp.ClientConnectorError):
        return UpstreamConnectError(type(exc).__name__)
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return UpstreamTimeout(type(exc).__name__)
    if isinstance(exc, aiohttp.ClientError | ConnectionError | OSError):
        return UpstreamResetError(type(exc).__name__)
    return None


class Upstream:
    """One configured upstream: its client session, base URL and auth.

    :param name: the config name (``upstreams.<name>``).
    :param config: its :class:`~sidecar.config.UpstreamConfig`.
    :param api_key: the value of ``api_key_env`` (None: pass client auth through).
    """

    def __init__(self, name: str, config: UpstreamConfig, api_key: str | None) -> None:
        self.name = name
        self.config = config
        self.api_key = api_key
        self.base = config.base_url.rstrip("/")
        """``base_url`` without a trailing slash; request targets are appended to it."""
        self.first_byte_s = config.first_byte_timeout_ms / 1000
        self.idle_s = config.idle_timeout_ms / 1000
        r = config.retry
        self.retry_statuses = frozenset(r.statuses)
        self.retry_after_max_s = r.retry_after_max_ms / 1000
        cb = config.circuit_breaker
        self.failure_statuses: frozenset[int] = (
            frozenset(cb.failure_statuses) if cb is not None else frozenset()
        )
        self.retry_exceptions: set[type[Exception]] = {UpstreamConnectError, UpstreamResetError}
        if r.retry_on_timeout:
            self.retry_exceptions.add(UpstreamTimeout)
        self.session: aiohttp.ClientSession | None = None
        self.retry_client: RetryClient | None = None

    async def start(self) -> None:
        """Create the client session (one connection pool of ``max_connections``; response
        header lines and fields up to ``max_response_header_bytes``)."""
        c = self.config
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_mark_reused)
        trace.on_connection_queued_start.append(_queued)
        trace.on_connection_queued_end.append(_dequeued)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=c.max_connections, limit_per_host=0),
            trace_configs=[trace],
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=c.connect_timeout_ms / 1000),
            auto_decompress=False,
            skip_auto_headers=SKIP_AUTO_HEADERS,
            raise_for_status=False,
            # aiohttp's 8190-byte default fails healthy providers whose CDN sends a
            # long Set-Cookie or tracing header; past this it is a broken response.
            max_line_size=c.max_response_header_bytes,
            max_field_size=c.max_response_header_bytes,
        )
        self.retry_client = RetryClient(
            client_session=cast(aiohttp.ClientSession, _AttemptSender()),
            retry_options=_UpstreamRetryOptions(self),
            logger=_QUIET,
        )

    async def close(self) -> None:
        """Close the session and every pooled connection."""
        if self.session is not None:
            await self.session.close()

    def url(self, path_qs: str) -> URL:
        """The upstream URL for a request path+query, appended to ``base_url`` as received."""
        return URL(self.base + path_qs, encoded=True)

    def headers(self, client_headers: Mapping[str, str]) -> CIMultiDict[str]:
        """Headers for this upstream built from the client's (see :mod:`sidecar.headers`)."""
        return upstream_request_headers(
            client_headers,
            extra=self.config.headers,
            auth_header=self.config.auth_header,
            api_key=self.api_key,
        )


async def _mark_reused(
    session: aiohttp.ClientSession,
    ctx: Any,
    params: aiohttp.TraceConnectionReuseconnParams,
) -> None:
    """Trace hook: note that this request went out on a pooled keep-alive connection."""
    if isinstance(ctx.trace_request_ctx, _Sent):
        ctx.trace_request_ctx.reused = True


async def _queued(
    session: aiohttp.ClientSession,
    ctx: Any,
    params: aiohttp.TraceConnectionQueuedStartParams,
) -> None:
    """Trace hook: every pooled connection is busy (``max_connections``); this request waits.

    The wait is the sidecar's own, not the upstream's: the first-byte clock stops (the
    request deadline still bounds it), so a busy pool is never a ``timeout`` failure.
    """
    sent = ctx.trace_request_ctx
    if isinstance(sent, _Sent):
        sent.queued = True
    if isinstance(sent, _Sent) and sent.first_byte is not None and not sent.first_byte.expired():
        sent.first_byte.reschedule(None)


async def _dequeued(
    session: aiohttp.ClientSession,
    ctx: Any,
    params: aiohttp.TraceConnectionQueuedEndParams,
) -> None:
    """Trace hook: a connection slot is free; the first-byte clock starts from now."""
    sent = ctx.trace_request_ctx
    if isinstance(sent, _Sent):
        sent.queued = False
    if isinstance(sent, _Sent) and sent.first_byte is not None and not sent.first_byte.expired():
        sent.first_byte.reschedule(asyncio.get_running_loop().time() + sent.first_byte_s)


class _Sent:
    """Per-send trace context: whether the connection was reused from the pool, and the
    first-byte timeout to pause while waiting for a pooled connection."""

    __slots__ = ("first_byte", "first_byte_s", "queued", "reused")

    def __init__(self, first_byte: asyncio.Timeout | None = None, first_byte_s: float = 0) -> None:
        self.reused = False
        self.queued = False
        """True while the request waits for a pooled connection (nothing sent yet)."""
        self.first_byte = first_byte
        self.first_byte_s = first_byte_s


class Answer:
    """A final HTTP answer of a candidate call, before the commit point.

    ``response`` is open (the caller relays or releases it); ``first_chunk`` is
    the first body chunk when already read (``b""`` = empty body), or None.
    """

    __slots__ = ("first_chunk", "response", "retry_after_s", "upstream")

    def __init__(
        self,
        upstream: Upstream,
        response: aiohttp.ClientResponse,
        first_chunk: bytes | None,
        retry_after_s: float | None,
    ) -> None:
        self.upstream = upstream
        self.response = response
        self.first_chunk = first_chunk
        self.retry_after_s = retry_after_s


class AttemptObserver:
    """Callbacks a candidate call reports to (metrics, attempt counts, breaker hints).

    The proxy subclasses this; the defaults do nothing. They must not raise.
    """

    def attempt(self, outcome: Outcome, first_byte_s: float | None) -> None:
        """One HTTP attempt ended with ``outcome`` (first byte after ``first_byte_s`` seconds)."""

    def retrying(self) -> None:
        """A retry is about to be sent on this candidate."""

    def failing_answer(self, retry_after_s: float) -> None:
        """A failing answer carried ``Retry-After`` (seconds, already capped)."""

    def may_retry(self) -> bool:
        """Whether a retry may be sent (False: stop here; e.g. the breaker opened).

        Asked before the backoff wait and again after it.
        """
        return True

    def time_left(self) -> float:
        """Seconds left before the request deadline (a longer wait to retry is futile)."""
        return float("inf")


class _GiveUp(Exception):
    """Stop retrying on this candidate; the last result stands."""


class CandidateCall:
    """One candidate call: attempts and retries on one upstream, up to the commit point.

    Use :meth:`run`; it returns an :class:`Answer` or raises an
    :class:`~sidecar.outcome.UpstreamError` (after the retries), never anything
    from aiohttp.
    """

    def __init__(
        self,
        upstream: Upstream,
        *,
        method: str,
        url: URL,
        headers: CIMultiDict[str],
        body: bytes,
        clock: Clock,
        observer: AttemptObserver,
    ) -> None:
        self.upstream = upstream
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.clock = clock
        self.observer = observer
        self.sent = 0
        self.pending_wait = 0.0
        self.last_answer: Answer | None = None
        # The latest attempt's transport failure, kept while its retry is pending
        # (so a deadline that expires then answers 502, not 504).
        self.last_error: UpstreamError | None = None
        self._sent: _Sent | None = None

    async def run(self) -> Answer:
        """Send the attempts; see the class docstring. Cancellation releases everything."""
        up = self.upstream
        assert up.retry_client is not None
        token = _CALL.set(self)
        try:
            response = await up.retry_client.request(self.method, self.url)
        except _GiveUp:
            if self.last_answer is not None:
                return self.last_answer
            assert self.last_error is not None
            raise self.last_error from None
        except BaseException:
            self._discard_last()
            raise
        finally:
            _CALL.reset(token)
        answer = self.last_answer
        assert answer is not None and answer.response is response
        return answer

    def _discard_last(self) -> None:
        if self.last_answer is not None:
            self.last_answer.response.release()
            self.last_answer = None

    async def send_once(self) -> aiohttp.ClientResponse:
        """One attempt (called by aiohttp-retry through :class:`_AttemptSender`)."""
        up = self.upstream
        if self.sent:
            if not self.observer.may_retry():
                raise _GiveUp()
            if self.pending_wait > 0:
                await self.clock.sleep(self.pending_wait)
            if not self.observer.may_retry():
                raise _GiveUp()
            self._discard_last()
            self.observer.retrying()
        self.sent += 1
        assert up.session is not None
        started = self.clock.now()
        first: bytes | None = None
        try:
            async with asyncio.timeout(up.first_byte_s) as first_byte:
                response = await self._send(first_byte)
                try:
                    _check_header_fields(response)
                    if response.status not in up.retry_statuses:
                        first = await response.content.readany()
                except BaseException:
                    response.release()
                    raise
        except asyncio.CancelledError:
            # Client gone or request deadline: the attempt was sent, then cut. One
            # still waiting for a pooled connection was never sent: no attempt.
            if self._sent is None or not self._sent.queued:
                self.observer.attempt(Outcome.CANCELLED, None)
            raise
        except TimeoutError as exc:
            # aiohttp's ConnectionTimeoutError is a TimeoutError too, but a connect
            # timeout is a connect error (contract): let translate() classify it.
            mapped_timeout = translate(exc) if isinstance(exc, aiohttp.ClientError) else None
            err: UpstreamError = mapped_timeout or UpstreamTimeout("first byte")
            self._failed(err)
            raise err from None
        except Exception as exc:
            mapped = translate(exc)
            if mapped is None:
                raise
            self._failed(mapped)
            raise mapped from None
        elapsed = self.clock.now() - started
        retry_after = None
        if response.status >= 400:
            retry_after = parse_retry_after(
                response.headers.get("Retry-After"), self.clock.wall(self.clock.now())
            )
            # Only a failing answer's Retry-After may extend an open breaker (contract);
            # a caller error (400, ...) is neutral.
            if retry_after is not None and response.status in up.failure_statuses:
                self.observer.failing_answer(min(retry_after, up.retry_after_max_s))
        self.last_error = None
        self.last_answer = Answer(up, response, first, retry_after)
        self.observer.attempt(
            status_outcome(response.status, first == b""), elapsed if first else None
        )
        return response

    async def _send(self, first_byte: asyncio.Timeout | None = None) -> aiohttp.ClientResponse:
        """Send the request; resend once if a reused keep-alive connection was dead.

        Contract: a request that fails on a reused keep-alive connection before
        any response byte (the upstream closed an idle connection) is resent once
        on a new connection, outside the retry budget and unseen by the breaker
        (RFC 9112 section 9.3.1 allows this retry; aiohttp does it only for
        idempotent methods).

        :param first_byte: the attempt's first-byte timeout, paused while the
            request waits for a pooled connection (see :func:`_queued`).
        """
        up = self.upstream
        assert up.session is not None
        for resend in (False, True):
            sent = self._sent = _Sent(first_byte, up.first_byte_s)
            try:
                return await up.session.request(
                    self.method,
                    self.url,
                    headers=self.headers,
                    data=self.body or None,
                    allow_redirects=False,
                    trace_request_ctx=sent,
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if resend or not sent.reused or isinstance(exc, aiohttp.ClientConnectorError):
                    raise
        raise AssertionError("unreachable")

    def _failed(self, err: UpstreamError) -> None:
        self.last_error = err
        self.observer.attempt(err.outcome, None)

    def next_wait(self, backoff_s: float, response: aiohttp.ClientResponse | None) -> None:
        """Decide the wait before the next attempt (called from the retry options).

        :raises _GiveUp: ``Retry-After`` asks for longer than ``retry_after_max_ms``, or
            the wait would outlast the request deadline: fall back now instead of
            letting the deadline end the request with no other candidate tried.
        """
        answer = self.last_answer
        retry_after = answer.retry_after_s if answer is not None and response is not None else None
        if retry_after is not None:
            if retry_after > self.upstream.retry_after_max_s:
                raise _GiveUp()
            self.pending_wait = retry_after
        else:
            self.pending_wait = backoff_s
        if self.pending_wait >= self.observer.time_left():
            raise _GiveUp()


class _QuietLogger:
    """Swallows aiohttp-retry's per-attempt debug lines (it still builds their text);
    our metrics and logs say what happened."""

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        pass

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        pass

    def exception(self, msg: str, *args: Any, **kwargs: Any) -> None:
        pass


_QUIET = _QuietLogger()

_CALL: contextvars.ContextVar[CandidateCall] = contextvars.ContextVar("sidecar_candidate_call")
"""The candidate call running in this task: one RetryClient per upstream serves every call."""


class _AttemptSender:
    """Duck-typed stand-in for ``ClientSession`` handed to :class:`RetryClient`.

    Each "request" aiohttp-retry makes is one attempt of the task's current
    :class:`CandidateCall`.
    """

    async def request(self, *_: Any, **__: Any) -> aiohttp.ClientResponse:
        return await _CALL.get().send_once()


class _EveryMethod:
    """A method set that contains every method (for aiohttp-retry's ``methods`` check)."""

    def __contains__(self, method: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())


_EVERY_METHOD = _EveryMethod()


class _UpstreamRetryOptions(ExponentialRetry):
    """An upstream's retry policy: configured statuses and errors, backoff, Retry-After."""

    def __init__(self, up: Upstream) -> None:
        r = up.config.retry
        super().__init__(
            attempts=1 + r.max_retries,
            start_timeout=r.backoff_initial_ms / 1000,
            max_timeout=r.backoff_max_ms / 1000,
            factor=2.0,
            statuses=set(up.retry_statuses),
            exceptions=up.retry_exceptions,
            retry_all_server_errors=False,
        )
        # aiohttp-retry retries on a status only for the methods it lists (a fixed
        # set without, e.g., QUERY); the contract retries every method.
        self.methods = _EVERY_METHOD

    def get_timeout(self, attempt: int, response: aiohttp.ClientResponse | None = None) -> float:
        # ExponentialRetry waits start * 2**attempt; attempt 1 should wait `start`.
        backoff = float(super().get_timeout(attempt - 1, response))
        _CALL.get().next_wait(backoff, response)
        return 0.0  # the wait happens on the injected clock in send_once

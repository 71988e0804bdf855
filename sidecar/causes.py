"""The cause of a failed upstream attempt (pure, no IO): what the logs say went wrong.

Contract, "Logs": the access log's ``upstream_error`` is the cause of the last failed
attempt, and a failed attempt with a transport cause is also logged (rate limited) as
``upstream_attempt_failed`` with a ``detail``. :func:`classify` turns an aiohttp client
exception (or an OS or TLS error) into a cause and a detail; :func:`answer_cause` names
a failing HTTP answer. Causes, from the exception raised::

    dns              ClientConnectorDNSError (socket.gaierror): the name did not resolve
    refused          any other ClientConnectorError: ECONNREFUSED, and also what a
                     blocked egress gives (EHOSTUNREACH, ENETUNREACH, EPERM, EACCES)
    tls              ClientSSLError (certificate not trusted, hostname mismatch,
                     handshake failure), ServerFingerprintMismatch, an ssl.SSLError
    proxy            the egress proxy refused the CONNECT (ClientHttpProxyError) or could
                     not be reached (ClientProxyConnectionError), or, with a proxy in
                     use, any other connect failure but TLS and a timeout (the proxy's
                     own name did not resolve, ...)
    connect_timeout  ConnectionTimeoutError (``connect_timeout_ms``), ETIMEDOUT
    timeout          any other timeout (the sidecar's ``first_byte_timeout_ms``)
    reset            anything else: the connection broke, or the response was malformed

The detail is the exception's class and the OS or TLS reason only (``os.strerror`` of
the errno, ``gai_strerror``'s text, OpenSSL's reason or verify message): never the
exception's own message, which aiohttp builds with the host, the URL or the proxy's
answer (contract: never a URL, header or key).
"""

from __future__ import annotations

import errno
import os
import socket
import ssl

import aiohttp

from sidecar.outcome import Outcome

DNS = "dns"
REFUSED = "refused"
TLS = "tls"
PROXY = "proxy"
RESET = "reset"
CONNECT_TIMEOUT = "connect_timeout"
TIMEOUT = "timeout"
SSE_ERROR = "sse_error"
EMPTY_TURN = "empty_turn"

TRANSPORT_CAUSES = frozenset({DNS, REFUSED, TLS, PROXY, RESET, CONNECT_TIMEOUT, TIMEOUT})
"""The causes logged as ``upstream_attempt_failed`` (not ``http_<status>``, ``sse_error``,
``empty_turn``: an answer came)."""

_TIMED_OUT = frozenset({errno.ETIMEDOUT})


def classify(exc: BaseException, proxied: bool = False) -> tuple[str, str]:
    """The cause and detail of an attempt that failed with ``exc``.

    :param exc: an aiohttp client exception, an :class:`OSError` or an :class:`ssl.SSLError`
        (another exception is a ``reset`` with its class as the detail).
    :param proxied: the attempt went through an egress proxy (``HTTPS_PROXY`` ...): a
        connect failure other than TLS or a timeout is then the proxy's.
    :returns: ``(cause, detail)``, ``cause`` one of :data:`TRANSPORT_CAUSES`; ``detail``
        such as ``"ClientConnectorError: [Errno 111] Connection refused"``.
    """
    name = type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return CONNECT_TIMEOUT, f"{name}: connect_timeout_ms ran out"
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one
        return TIMEOUT, name
    tls = _tls_error(exc)
    if tls is not None:
        return TLS, f"{name}: {_tls_reason(tls)}"
    if isinstance(exc, aiohttp.ServerFingerprintMismatch):
        return TLS, f"{name}: certificate fingerprint mismatch"
    if isinstance(exc, aiohttp.ClientHttpProxyError):
        status = getattr(exc, "status", None)
        return PROXY, f"{name}: CONNECT answered {status}" if type(status) is int else name
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = _os_error(exc)
        detail = name if os_error is None else f"{name}: {_os_reason(os_error)}"
        if proxied or isinstance(exc, aiohttp.ClientProxyConnectionError):
            return PROXY, detail
        if isinstance(exc, aiohttp.ClientConnectorDNSError) or isinstance(
            os_error, socket.gaierror
        ):
            return DNS, detail
        if os_error is not None and os_error.errno in _TIMED_OUT:
            return CONNECT_TIMEOUT, detail
        return REFUSED, detail
    if isinstance(exc, OSError) and exc.errno is not None:
        return RESET, f"{name}: {_os_reason(exc)}"
    return RESET, name


def answer_cause(outcome: Outcome, status: int) -> str:
    """The cause of a failing answer: ``sse_error``, ``empty_turn`` or ``http_<status>``."""
    if outcome is Outcome.SSE_ERROR:
        return SSE_ERROR
    if outcome is Outcome.EMPTY_TURN:
        return EMPTY_TURN
    return f"http_{status}"


def _tls_error(exc: BaseException) -> BaseException | None:
    """The TLS error in ``exc`` (itself, the one aiohttp wraps, or its cause), or None."""
    if isinstance(exc, aiohttp.ClientSSLError):
        inner = getattr(exc, "certificate_error", None) or _os_error(exc)
        return inner if isinstance(inner, ssl.SSLError | ssl.CertificateError) else exc
    for candidate in (exc, exc.__cause__):
        if isinstance(candidate, ssl.SSLError | ssl.CertificateError):
            return candidate
    return None


def _os_error(exc: aiohttp.ClientConnectorError) -> OSError | None:
    """The OS error aiohttp wraps in ``exc`` (None when it has none)."""
    try:
        return exc.os_error
    except AttributeError:  # made without its arguments
        return None


def _tls_reason(err: BaseException) -> str:
    """OpenSSL's verify message or reason (``unable to get local issuer certificate``,
    ``WRONG_VERSION_NUMBER``), else the class name of ``err``."""
    message = getattr(err, "verify_message", None)
    if message:
        return str(message)
    reason = getattr(err, "reason", None)
    return str(reason) if reason else type(err).__name__


def _os_reason(err: OSError) -> str:
    """``[Errno n] <strerror of n>`` (the system's text for the number, not the message
    asyncio built with the address), ``gai_strerror``'s text for a resolver error, or
    the class name when there is no number."""
    code = err.errno
    if isinstance(err, socket.gaierror) and err.strerror:
        return f"[Errno {code}] {err.strerror}"
    if isinstance(code, int) and code > 0:
        return f"[Errno {code}] {os.strerror(code)}"
    return type(err).__name__

"""The cause of a failed attempt, from the exception (contract, "Logs": ``upstream_error``
and ``upstream_attempt_failed``'s ``detail``): one table, and the rate limit of the warning."""

from __future__ import annotations

import json
import logging
import socket
import ssl

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from sidecar.attempt_warnings import INTERVAL_S, AttemptWarnings
from sidecar.breakers.types import Target
from sidecar.causes import TRANSPORT_CAUSES, answer_cause, classify
from sidecar.logs import JsonFormatter
from sidecar.outcome import Outcome, UpstreamConnectError, UpstreamResetError, UpstreamTimeout
from sidecar.upstream import translate

HOST = "private-host.example"
KEY = ConnectionKey(HOST, 443, True, True, None, None, None, None)
INFO = aiohttp.RequestInfo(URL(f"https://{HOST}/v1"), "CONNECT", CIMultiDictProxy(CIMultiDict()))


def _cert_error() -> ssl.SSLCertVerificationError:
    err = ssl.SSLCertVerificationError(
        1, f"[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed ({HOST})"
    )
    err.verify_message = "unable to get local issuer certificate"
    err.reason = "CERTIFICATE_VERIFY_FAILED"
    return err


def _ssl_error() -> ssl.SSLError:
    err = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
    err.reason = "WRONG_VERSION_NUMBER"
    return err


REFUSED = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 9)")
GAI = socket.gaierror(-2, "Name or service not known")

TABLE: list[tuple[BaseException, bool, str, str]] = [
    # (exception, proxied, cause, detail)
    (
        aiohttp.ClientConnectorDNSError(KEY, GAI),
        False,
        "dns",
        "ClientConnectorDNSError: [Errno -2] Name or service not known",
    ),
    (
        aiohttp.ClientConnectorError(KEY, REFUSED),
        False,
        "refused",
        "ClientConnectorError: [Errno 111] Connection refused",
    ),
    (  # an egress blocked by a REJECT rule: the OS reason tells it apart
        aiohttp.ClientConnectorError(KEY, OSError(113, "Connect call failed")),
        False,
        "refused",
        "ClientConnectorError: [Errno 113] No route to host",
    ),
    (  # the kernel's own SYN timeout
        aiohttp.ClientConnectorError(KEY, TimeoutError(110, "Connect call failed")),
        False,
        "connect_timeout",
        "ClientConnectorError: [Errno 110] Connection timed out",
    ),
    (
        aiohttp.ClientConnectorCertificateError(KEY, _cert_error()),
        False,
        "tls",
        "ClientConnectorCertificateError: unable to get local issuer certificate",
    ),
    (
        aiohttp.ClientConnectorSSLError(KEY, _ssl_error()),
        False,
        "tls",
        "ClientConnectorSSLError: WRONG_VERSION_NUMBER",
    ),
    (  # TLS through a proxy's tunnel is the origin's: still tls
        aiohttp.ClientConnectorCertificateError(KEY, _cert_error()),
        True,
        "tls",
        "ClientConnectorCertificateError: unable to get local issuer certificate",
    ),
    (
        aiohttp.ClientProxyConnectionError(KEY, REFUSED),
        False,
        "proxy",
        "ClientProxyConnectionError: [Errno 111] Connection refused",
    ),
    (
        aiohttp.ClientHttpProxyError(INFO, (), status=403, message=f"Forbidden {HOST}"),
        True,
        "proxy",
        "ClientHttpProxyError: CONNECT answered 403",
    ),
    (  # the proxy's own name did not resolve: the proxy failed
        aiohttp.ClientConnectorDNSError(KEY, GAI),
        True,
        "proxy",
        "ClientConnectorDNSError: [Errno -2] Name or service not known",
    ),
    (
        aiohttp.ConnectionTimeoutError(f"Connection timeout to host https://{HOST}/v1"),
        False,
        "connect_timeout",
        "ConnectionTimeoutError: connect_timeout_ms ran out",
    ),
    (aiohttp.ServerTimeoutError("read"), False, "timeout", "ServerTimeoutError"),
    (
        aiohttp.ServerDisconnectedError(f"from {HOST}"),
        False,
        "reset",
        "ServerDisconnectedError",
    ),
    (
        aiohttp.ClientOSError(104, "Connection reset by peer"),
        False,
        "reset",
        "ClientOSError: [Errno 104] Connection reset by peer",
    ),
    (
        ConnectionResetError(104, "Connection reset by peer"),
        False,
        "reset",
        "ConnectionResetError: [Errno 104] Connection reset by peer",
    ),
    (
        aiohttp.ClientPayloadError(f"https://{HOST}/x cut"),
        False,
        "reset",
        "ClientPayloadError",
    ),
    (aiohttp.ServerFingerprintMismatch(b"a", b"b", HOST, 443), False, "tls", ""),
]


@pytest.mark.parametrize(
    ("exc", "proxied", "cause", "detail"),
    TABLE,
    ids=[f"{type(e).__name__}{'-proxied' if p else ''}" for e, p, _, _ in TABLE],
)
def test_cause_and_detail(exc: BaseException, proxied: bool, cause: str, detail: str) -> None:
    got_cause, got_detail = classify(exc, proxied)
    assert got_cause == cause
    if detail:
        assert got_detail == detail
    assert got_cause in TRANSPORT_CAUSES
    # Never the host, a URL or an address aiohttp or asyncio put in the message.
    for secret in (HOST, "https://", "127.0.0.1"):
        assert secret not in got_detail


def test_translate_carries_cause_and_detail() -> None:
    err = translate(aiohttp.ClientConnectorError(KEY, REFUSED))
    assert type(err) is UpstreamConnectError
    assert (err.cause, err.detail) == (
        "refused",
        "ClientConnectorError: [Errno 111] Connection refused",
    )
    proxy = translate(aiohttp.ClientHttpProxyError(INFO, (), status=407), proxied=True)
    assert type(proxy) is UpstreamConnectError  # a connect error of that upstream (contract)
    assert proxy.cause == "proxy"
    assert type(translate(aiohttp.ServerTimeoutError())) is UpstreamTimeout
    reset = translate(aiohttp.ServerDisconnectedError())
    assert type(reset) is UpstreamResetError
    assert reset.cause == "reset"
    # The sidecar's own errors keep their class's cause.
    assert UpstreamTimeout("first_byte_timeout_ms ran out").cause == "timeout"
    assert UpstreamResetError("unsolicited 101").cause == "reset"


@pytest.mark.parametrize(
    ("outcome", "status", "cause"),
    [
        (Outcome.HTTP_5XX, 503, "http_503"),
        (Outcome.HTTP_429, 429, "http_429"),
        (Outcome.SSE_ERROR, 200, "sse_error"),
        (Outcome.EMPTY_TURN, 200, "empty_turn"),
    ],
)
def test_answer_causes(outcome: Outcome, status: int, cause: str) -> None:
    assert answer_cause(outcome, status) == cause
    assert cause not in TRANSPORT_CAUSES  # an answer came: not warned about


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.formatter = JsonFormatter()
        self.lines: list[dict[str, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "upstream_attempt_failed":
            self.lines.append(json.loads(self.format(record)))


def test_warning_once_per_target_and_cause_per_minute() -> None:
    lines = _Lines()
    logger = logging.getLogger("sidecar")
    logger.addHandler(lines)
    try:
        warnings = AttemptWarnings()
        a, b = Target("primary", "gpt-4o"), Target("backup", "*")
        refused = UpstreamConnectError("ClientConnectorError: [Errno 111] x", "refused")
        dns = UpstreamConnectError("ClientConnectorDNSError: [Errno -2] y", "dns")
        t = 1000.0
        assert warnings.failed(a, refused, t)
        assert not warnings.failed(a, refused, t + 1)  # same target and cause
        assert warnings.failed(a, dns, t + 1)  # another cause
        assert warnings.failed(b, refused, t + 2)  # another target
        assert not warnings.failed(a, refused, t + INTERVAL_S - 0.001)
        assert warnings.failed(a, refused, t + INTERVAL_S)  # a minute later: again
        assert not warnings.failed(a, UpstreamConnectError("x", "http_503"), t)  # not transport
    finally:
        logger.removeHandler(lines)
    assert [{k: v for k, v in got.items() if k != "ts"} for got in lines.lines] == [
        {
            "level": "warning",
            "event": "upstream_attempt_failed",
            "upstream": up,
            "model": model,
            "cause": cause,
            "detail": detail,
        }
        for up, model, cause, detail in [
            ("primary", "gpt-4o", "refused", "ClientConnectorError: [Errno 111] x"),
            ("primary", "gpt-4o", "dns", "ClientConnectorDNSError: [Errno -2] y"),
            ("backup", "*", "refused", "ClientConnectorError: [Errno 111] x"),
            ("primary", "gpt-4o", "refused", "ClientConnectorError: [Errno 111] x"),
        ]
    ]

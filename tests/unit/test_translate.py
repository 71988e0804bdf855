"""Every aiohttp client exception maps to one of the sidecar's upstream errors (one boundary)."""

from __future__ import annotations

import aiohttp
import aiohttp.client_exceptions as ce
import pytest

from sidecar.outcome import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamResetError,
    UpstreamTimeout,
)
from sidecar.upstream import translate

CLIENT_ERRORS = [
    c
    for c in (getattr(ce, n) for n in ce.__all__)
    if isinstance(c, type) and issubclass(c, aiohttp.ClientError)
]


@pytest.mark.parametrize("cls", CLIENT_ERRORS, ids=lambda c: c.__name__)
def test_every_client_error_is_mapped(cls: type[aiohttp.ClientError]) -> None:
    assert isinstance(translate(cls.__new__(cls)), UpstreamError)


@pytest.mark.parametrize(
    ("cls", "ours"),
    [
        (aiohttp.ClientConnectorError, UpstreamConnectError),
        (aiohttp.ClientConnectorDNSError, UpstreamConnectError),
        (aiohttp.ClientConnectorCertificateError, UpstreamConnectError),
        (aiohttp.ConnectionTimeoutError, UpstreamConnectError),  # a connect timeout
        (aiohttp.ClientProxyConnectionError, UpstreamConnectError),
        (aiohttp.ClientHttpProxyError, UpstreamConnectError),  # the egress proxy refused
        (aiohttp.ServerTimeoutError, UpstreamTimeout),
        (aiohttp.SocketTimeoutError, UpstreamTimeout),
        (aiohttp.ServerDisconnectedError, UpstreamResetError),
        (aiohttp.ClientPayloadError, UpstreamResetError),
        (aiohttp.ClientOSError, UpstreamResetError),
    ],
)
def test_the_kinds_that_matter(cls: type[Exception], ours: type[UpstreamError]) -> None:
    assert type(translate(cls.__new__(cls))) is ours


def test_os_errors_are_resets_and_others_pass_through() -> None:
    assert type(translate(ConnectionResetError())) is UpstreamResetError
    assert translate(ValueError("a bug")) is None

"""The cause of a failed attempt, through the running sidecar (contract, "Logs").

Each failure is a real one on loopback: a name under ``.invalid`` (RFC 6761 section 6.4:
it resolves nowhere, no network needed), a closed port, a certificate from a CA the
sidecar does not trust, a full accept queue (a connect that hangs), a first byte that
never comes, a connection closed before the answer, a 503, an egress proxy that
refuses the ``CONNECT``. The access log's
``upstream_error`` names the cause of the last failed attempt; a transport cause is also
an ``upstream_attempt_failed`` warning, once per target and cause per minute on the
injected clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import trustme

from sidecar.testing import FakeClock, FakeUpstream, Fault, closed_port, saturated_listener
from tests.access_log_helpers import CHAT, Lines, access_config, capture, line, post, without_ts
from tests.conftest import StartSidecar, on_fake_time
from tests.tls_helpers import tls_fake

WARNING = "upstream_attempt_failed"


@pytest.fixture
def access() -> Iterator[Lines]:
    yield from capture()


def warnings(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    out = []
    for r in caplog.records:
        if r.getMessage() == WARNING:
            assert r.levelname == "WARNING"
            out.append(dict(r.fields))  # type: ignore[attr-defined]
    return out


@pytest_asyncio.fixture
async def tls_upstream() -> AsyncIterator[FakeUpstream]:
    """An HTTPS fake whose certificate comes from a throwaway CA nobody trusts."""
    fake = await tls_fake(trustme.CA())
    yield fake
    await fake.close()


FAILED: dict[str, Any] = {"status": 502, "upstream": None, "attempts": 2, "duration_ms": 10.0}
FAILED |= {"first_byte_ms": None, "outcome": "upstream_error", "error": "upstream_unavailable"}


async def _one_failure(
    start_sidecar: StartSidecar, http: aiohttp.ClientSession, base_url: str, **keys: Any
) -> int:
    sc = await start_sidecar(access_config(base_url, **keys))
    return await post(http, sc.proxy_url + CHAT)


@pytest.mark.parametrize(
    ("name", "detail"),
    [
        ("dns", "ClientConnectorDNSError: [Errno "),
        ("refused", "ClientConnectorError: [Errno 111] Connection refused"),
    ],
)
async def test_dns_and_refused(
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
    name: str,
    detail: str,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    host = "sidecar-test.invalid" if name == "dns" else f"127.0.0.1:{closed_port()}"
    assert await _one_failure(start_sidecar, http, f"http://{host}") == 502
    assert without_ts(await access.wait(1)) == [line(**FAILED, upstream_error=name)]
    # Two failed attempts, one warning: once per target and cause per minute.
    [got] = warnings(caplog)
    assert got["detail"].startswith(detail)
    assert got == {"upstream": "primary", "model": "*", "cause": name, "detail": got["detail"]}
    assert host.split(":")[0] not in got["detail"]


async def test_an_untrusted_certificate_is_tls(
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
    tls_upstream: FakeUpstream,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    assert await _one_failure(start_sidecar, http, tls_upstream.url) == 502
    assert without_ts(await access.wait(1)) == [line(**FAILED, upstream_error="tls")]
    assert warnings(caplog) == [
        {
            "upstream": "primary",
            "model": "*",
            "cause": "tls",
            "detail": "ClientConnectorCertificateError: unable to get local issuer certificate",
        }
    ]
    assert tls_upstream.request_count == 0


async def test_a_connect_that_hangs_is_connect_timeout(
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    host, port, cleanup = await saturated_listener()
    try:
        status = await _one_failure(
            start_sidecar, http, f"http://{host}:{port}", connect_timeout_ms=100
        )
    finally:
        cleanup()
    assert status == 502
    assert without_ts(await access.wait(1)) == [line(**FAILED, upstream_error="connect_timeout")]
    assert [w["cause"] for w in warnings(caplog)] == ["connect_timeout"]


async def test_no_first_byte_is_timeout(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    sc = await start_sidecar(access_config(fake.url, first_byte_timeout_ms=150))
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
    answer = post(http, sc.proxy_url + CHAT)
    assert await on_fake_time(clock, fake, [(1, 0.15)], answer) == 504
    [got] = without_ts(await access.wait(1))
    assert (got["error"], got["upstream_error"]) == ("upstream_timeout", "timeout")
    assert warnings(caplog) == [
        {
            "upstream": "primary",
            "model": "*",
            "cause": "timeout",
            "detail": "first_byte_timeout_ms ran out",
        }
    ]


async def test_an_attempt_cut_by_the_request_deadline_is_timeout_without_a_warning(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    clock: FakeClock,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``request_timeout_ms`` (300 ms) runs out while the attempt waits for its first byte
    (``first_byte_timeout_ms`` 60 s): ``upstream_error`` is ``timeout``; no warning, the
    deadline is the request's budget, not that attempt's failure."""
    caplog.set_level("INFO", logger="sidecar")
    toml = access_config(fake.url, server={"request_timeout_ms": 300})
    sc = await start_sidecar(toml)
    fake.set_default(Fault(hold_first_chunk=asyncio.Event()))
    answer = post(http, sc.proxy_url + CHAT)
    assert await on_fake_time(clock, fake, [(1, 0.3)], answer) == 504
    [got] = without_ts(await access.wait(1))
    assert (got["error"], got["attempts"], got["upstream_error"]) == (
        "upstream_timeout",
        1,
        "timeout",
    )
    assert warnings(caplog) == []


async def test_a_connection_closed_before_the_answer_is_reset(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    fake.set_default(Fault(reset_before_headers=True))
    assert await _one_failure(start_sidecar, http, fake.url) == 502
    assert without_ts(await access.wait(1)) == [line(**FAILED, upstream_error="reset")]
    [got] = warnings(caplog)
    assert got["cause"] == "reset"
    assert got["detail"] == "ServerDisconnectedError"


async def test_an_http_failure_is_in_the_access_log_only(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    fake.set_default(Fault(status=503))
    assert await _one_failure(start_sidecar, http, fake.url) == 503
    [got] = without_ts(await access.wait(1))
    assert (got["status"], got["error"], got["upstream_error"]) == (503, None, "http_503")
    assert warnings(caplog) == []  # an answer came: not a transport cause


async def test_a_success_has_no_cause_and_a_later_success_keeps_the_last_one(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    sc = await start_sidecar(access_config(fake.url))
    assert await post(http, sc.proxy_url + CHAT) == 200
    # Closed on the reused connection, then on the new one it is resent on (the
    # resend-once rule: one attempt), then a success on the retry.
    fake.script([Fault(reset_before_headers=True)] * 2)
    assert await post(http, sc.proxy_url + CHAT) == 200
    lines = without_ts(await access.wait(2))
    assert [(g["attempts"], g["upstream_error"]) for g in lines] == [(1, None), (2, "reset")]
    assert [w["cause"] for w in warnings(caplog)] == ["reset"]


async def test_the_warning_is_rate_limited_per_target_and_cause_on_the_clock(
    start_sidecar: StartSidecar,
    clock: FakeClock,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    refused = f"http://127.0.0.1:{closed_port()}"
    sc = await start_sidecar(access_config(refused, "http://sidecar-test.invalid"))
    url = sc.proxy_url + CHAT
    # A connection per request: the sidecar's keep-alive timeout runs on the moved clock.
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    async with http:
        await _minutes(http, url, clock, caplog)
    lines = await access.wait(3)
    assert [g["upstream_error"] for g in lines] == ["dns"] * 3  # the last failed attempt's


async def _minutes(
    http: aiohttp.ClientSession, url: str, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    assert await post(http, url) == 502  # primary refused twice, backup dns once
    assert [(w["upstream"], w["cause"]) for w in warnings(caplog)] == [
        ("primary", "refused"),
        ("backup", "dns"),
    ]
    clock.advance(59.0)
    assert await post(http, url) == 502  # within the minute: nothing more
    assert len(warnings(caplog)) == 2
    clock.advance(2.0)  # past 60 s since the first ones
    assert await post(http, url) == 502
    assert [(w["upstream"], w["cause"]) for w in warnings(caplog)] == [
        ("primary", "refused"),
        ("backup", "dns"),
        ("primary", "refused"),
        ("backup", "dns"),
    ]


async def test_a_proxy_that_refuses_the_connect_is_proxy(
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
    tls_upstream: FakeUpstream,
) -> None:
    """A minimal forward proxy that answers every request 403 (the real one, tinyproxy,
    is in ``test_egress_proxy.py``): the attempt fails with cause ``proxy``."""
    caplog.set_level("INFO", logger="sidecar")
    asked: list[bytes] = []

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        sc = await start_sidecar(
            access_config(tls_upstream.url), environ={"https_proxy": f"http://127.0.0.1:{port}"}
        )
        assert await post(http, sc.proxy_url + CHAT) == 502
    finally:
        server.close()
        await server.wait_closed()
    assert without_ts(await access.wait(1)) == [line(**FAILED, upstream_error="proxy")]
    assert warnings(caplog) == [
        {
            "upstream": "primary",
            "model": "*",
            "cause": "proxy",
            "detail": "ClientHttpProxyError: CONNECT answered 403",
        }
    ]
    target = f"127.0.0.1:{tls_upstream.port}".encode()
    assert [a.split(b"\r\n")[0] for a in asked] == [b"CONNECT " + target + b" HTTP/1.1"] * 2

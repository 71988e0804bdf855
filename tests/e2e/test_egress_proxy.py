"""Upstreams behind an egress proxy and a private CA, end to end (contract, "Configuration":
``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY``, ``ca_file``; "Logs": the ``proxy`` and
``tls`` causes).

The proxy is a real one: Debian's ``tinyproxy``, started per test on a free loopback
port (:mod:`tests.tinyproxy_proc`; these tests skip when it is not installed, and
``.ci/run`` installs it). Behind it, an HTTPS fake upstream whose certificate comes
from a throwaway CA made in the test (``trustme``), trusted through ``ca_file``.
That a request went through the proxy is read in tinyproxy's own log (its ``CONNECT``
lines), and checked the other way round by stopping the proxy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import trustme

from sidecar.testing import FakeUpstream
from tests.access_log_helpers import CHAT, Lines, access_config, capture, post
from tests.conftest import StartSidecar
from tests.tinyproxy_proc import TinyProxy, tinyproxy_path
from tests.tls_helpers import ca_file, tls_fake

needs_tinyproxy = pytest.mark.skipif(
    tinyproxy_path() is None, reason="tinyproxy is not installed (Debian package tinyproxy)"
)

WARNING = "upstream_attempt_failed"


@pytest.fixture
def access() -> Iterator[Lines]:
    yield from capture()


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest_asyncio.fixture
async def tls_upstream(ca: trustme.CA) -> AsyncIterator[FakeUpstream]:
    """An HTTPS fake upstream on 127.0.0.1 with a certificate from ``ca``."""
    fake = await tls_fake(ca)
    yield fake
    await fake.close()


@pytest_asyncio.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[TinyProxy]:
    if tinyproxy_path() is None:
        pytest.skip("tinyproxy is not installed (Debian package tinyproxy)")
    p = await TinyProxy(tmp_path).start()
    yield p
    await p.stop()


def warnings(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        dict(r.fields)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == WARNING
    ]


async def test_ca_file_trusts_a_private_ca(
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    ca: trustme.CA,
    tls_upstream: FakeUpstream,
) -> None:
    sc = await start_sidecar(access_config(tls_upstream.url, ca_file=ca_file(tmp_path, ca)))
    assert await post(http, sc.proxy_url + CHAT) == 200
    assert tls_upstream.request_count == 1


@needs_tinyproxy
async def test_an_https_upstream_is_reached_through_the_proxy_with_connect(
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    ca: trustme.CA,
    tls_upstream: FakeUpstream,
    proxy: TinyProxy,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    toml = access_config(tls_upstream.url, ca_file=ca_file(tmp_path, ca))
    sc = await start_sidecar(toml, environ={"HTTPS_PROXY": proxy.url})
    url = sc.proxy_url + CHAT
    assert await post(http, url) == 200
    assert await post(http, url) == 200  # the tunnel is pooled and reused
    assert proxy.connects() == [f"127.0.0.1:{tls_upstream.port}"]
    assert tls_upstream.request_count == 2
    [egress] = [r for r in caplog.records if r.getMessage() == "upstream_egress_proxy"]
    assert egress.fields == {  # type: ignore[attr-defined]
        "upstream": "primary",
        "proxy": f"127.0.0.1:{proxy.port}",
        "variable": "HTTPS_PROXY",
    }
    # The proxy is the only route: without it, the upstream cannot be reached.
    await proxy.stop()
    assert await post(http, url) == 502
    lines = await access.wait(3)
    assert [(g["status"], g["upstream_error"]) for g in lines] == [
        (200, None),
        (200, None),
        (502, "proxy"),
    ]
    assert warnings(caplog) == [
        {
            "upstream": "primary",
            "model": "*",
            "cause": "proxy",
            "detail": "ClientProxyConnectionError: [Errno 111] Connection refused",
        }
    ]
    assert tls_upstream.request_count == 2


@needs_tinyproxy
@pytest.mark.parametrize(
    "no_proxy",
    [
        {"NO_PROXY": "127.0.0.1"},
        {"no_proxy": "localhost, 127.0.0.0/8"},  # lowercase; a CIDR entry
        {"NO_PROXY": "*"},
    ],
)
async def test_no_proxy_bypasses_it(
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    ca: trustme.CA,
    tls_upstream: FakeUpstream,
    proxy: TinyProxy,
    no_proxy: dict[str, str],
) -> None:
    toml = access_config(tls_upstream.url, ca_file=ca_file(tmp_path, ca))
    sc = await start_sidecar(toml, environ={"https_proxy": proxy.url, **no_proxy})
    assert await post(http, sc.proxy_url + CHAT) == 200
    assert tls_upstream.request_count == 1
    assert proxy.connects() == []
    assert not [line for line in proxy.lines if "Request (file descriptor" in line]


@needs_tinyproxy
async def test_a_wrong_ca_through_the_proxy_is_tls(
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    tls_upstream: FakeUpstream,
    proxy: TinyProxy,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    other = ca_file(tmp_path, trustme.CA(), "other-ca.pem")  # not the upstream's CA
    sc = await start_sidecar(
        access_config(tls_upstream.url, ca_file=other), environ={"HTTPS_PROXY": proxy.url}
    )
    assert await post(http, sc.proxy_url + CHAT) == 502
    [got] = await access.wait(1)
    assert (got["error"], got["upstream_error"]) == ("upstream_unavailable", "tls")
    assert [w["cause"] for w in warnings(caplog)] == ["tls"]
    # The tunnel was opened (twice: an attempt and its retry); TLS failed inside it.
    assert proxy.connects() == [f"127.0.0.1:{tls_upstream.port}"] * 2
    assert tls_upstream.request_count == 0


@needs_tinyproxy
async def test_a_proxy_that_refuses_the_connect_is_proxy(
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    ca: trustme.CA,
    tls_upstream: FakeUpstream,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    strict = await TinyProxy(tmp_path, connect_ports=[443]).start()  # tunnels to 443 only
    try:
        toml = access_config(tls_upstream.url, ca_file=ca_file(tmp_path, ca))
        sc = await start_sidecar(toml, environ={"HTTPS_PROXY": strict.url})
        assert await post(http, sc.proxy_url + CHAT) == 502
    finally:
        await strict.stop()
    [got] = await access.wait(1)
    assert (got["error"], got["upstream_error"]) == ("upstream_unavailable", "proxy")
    assert warnings(caplog) == [
        {
            "upstream": "primary",
            "model": "*",
            "cause": "proxy",
            "detail": "ClientHttpProxyError: CONNECT answered 403",
        }
    ]
    assert tls_upstream.request_count == 0


@needs_tinyproxy
async def test_an_http_upstream_goes_through_http_proxy_in_absolute_form(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    proxy: TinyProxy,
) -> None:
    # HTTPS_PROXY does not apply to an http:// upstream; HTTP_PROXY does.
    sc = await start_sidecar(
        access_config(fake.url),
        environ={"HTTP_PROXY": proxy.url, "HTTPS_PROXY": "http://127.0.0.1:9"},
    )
    assert await post(http, sc.proxy_url + CHAT) == 200
    assert fake.request_count == 1
    assert [line for line in proxy.lines if f"POST {fake.url}{CHAT} HTTP/1.1" in line]
    assert proxy.connects() == []


@needs_tinyproxy
async def test_proxy_credentials_are_sent_and_never_logged(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    ca: trustme.CA,
    tls_upstream: FakeUpstream,
    access: Lines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    secret = "proxy-pw-canary-7f3a1c"
    guarded = await TinyProxy(tmp_path, basic_auth=("egress", secret)).start()
    try:
        toml = access_config(tls_upstream.url, ca_file=ca_file(tmp_path, ca))
        proxy_url = guarded.url.replace("http://", f"http://egress:{secret}@")
        sc = await start_sidecar(toml, environ={"HTTPS_PROXY": proxy_url})
        assert await post(http, sc.proxy_url + CHAT) == 200
        wrong = await start_sidecar(toml, environ={"HTTPS_PROXY": guarded.url})  # no password
        assert await post(http, wrong.proxy_url + CHAT) == 502
        # An http upstream: no CONNECT, the credentials go on each request to the proxy.
        plain = await start_sidecar(access_config(fake.url), environ={"HTTP_PROXY": proxy_url})
        assert await post(http, plain.proxy_url + CHAT) == 200
    finally:
        await guarded.stop()
    assert tls_upstream.request_count == 1
    assert fake.request_count == 1
    assert [line for line in guarded.lines if f"POST {fake.url}{CHAT} HTTP/1.1" in line]
    lines = await access.wait(3)
    assert [g["upstream_error"] for g in lines] == [None, "proxy", None]
    assert [w["detail"] for w in warnings(caplog)] == ["ClientHttpProxyError: CONNECT answered 407"]
    assert secret not in caplog.text
    assert not [t for t in access.text if secret in t]

"""The relay keeps no cookies: one client's Set-Cookie never reaches another's request."""

from __future__ import annotations

import aiohttp

from sidecar.testing import FakeUpstream, Fault
from tests.configs import single
from tests.conftest import StartSidecar


async def test_an_upstream_set_cookie_is_relayed_but_never_replayed(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    # "localhost", not an IP address: aiohttp's default jar would store this cookie.
    port = fake.url.rsplit(":", 1)[1]
    sc = await start_sidecar(single(f"http://localhost:{port}", path_prefix=None))
    fake.script([Fault(headers={"Set-Cookie": "session=first-client; Path=/"})])
    async with http.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.status == 200
        assert r.headers["Set-Cookie"].startswith("session=first-client")
    # Another client, with its own cookie jar.
    async with (
        aiohttp.ClientSession() as other,
        other.post(sc.proxy_url + "/v1/chat/completions", json={"model": "m"}) as r,
    ):
        assert r.status == 200
    assert [req.headers.getall("Cookie", []) for req in fake.requests] == [[], []]

"""A compressed request body is relayed as it came, with its Content-Encoding."""

from __future__ import annotations

import gzip

import aiohttp

from sidecar.testing import FakeUpstream
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar


def catch_all(url: str) -> str:
    """Upstream ``re_one`` under a route ``all`` on ``/``."""
    return config(
        upstreams={"re_one": upstream(url)}, routes=[route("all", "re_one", path_prefix="/")]
    )


async def test_gzip_request_body_is_relayed_compressed(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(catch_all(fake.url))
    raw = b'{"model": "m", "input": "' + b"x" * 2000 + b'"}'
    packed = gzip.compress(raw)
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with http.post(sc.proxy_url + "/echo/upload", data=packed, headers=headers) as r:
        # The fake's own server decodes the gzip body it receives: a 200 and the
        # original document there mean the compressed bytes arrived with their header
        # (decompressed bytes under "Content-Encoding: gzip" fail to decode: a 500).
        assert r.status == 200
    got = fake.requests[-1]
    assert got.headers["Content-Encoding"] == "gzip"
    assert got.headers["Content-Length"] == str(len(packed))
    assert got.body == raw

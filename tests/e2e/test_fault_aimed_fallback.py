"""A fallback shown with the fake's fault header aimed at one fake (issue 23, item 7).

The sidecar relays a request's headers to every candidate it tries, ``x-fake-fault``
included, so that header alone makes the backup fail too. With ``x-fake-fault-for:
primary`` only the fake named ``primary`` misbehaves: the client sees the backup's
answer, and each fake saw what the route's rules say it should.
"""

from __future__ import annotations

import aiohttp

from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream
from tests.configs import fallback
from tests.conftest import StartSidecar

CHAT = "/v1/chat/completions"
FAULT = {"x-fake-fault": '{"status": 503}'}


async def start(start_sidecar: StartSidecar, fake: FakeUpstream, fake2: FakeUpstream) -> Sidecar:
    assert (fake.name, fake2.name) == ("primary", "backup")
    text = fallback(fake.url, fake2.url, primary={"retry": {"max_retries": 1}})
    return await start_sidecar(text)


async def test_a_fault_aimed_at_the_first_candidate_shows_the_fallback(
    start_sidecar: StartSidecar,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
) -> None:
    sc = await start(start_sidecar, fake, fake2)
    headers = {**FAULT, "x-fake-fault-for": "primary"}
    async with http.post(sc.proxy_url + CHAT, json={"model": "gpt-4o"}, headers=headers) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == "backup"
        assert (await r.json())["model"] == "gpt-4o"
    # The primary: the first attempt and its one retry, both 503 by the aimed fault.
    assert [rec.fault.status for rec in fake.requests] == [503, 503]
    # The backup got the same headers, the fault aimed elsewhere, and answered.
    assert [rec.fault.status for rec in fake2.requests] == [200]
    assert fake2.requests[0].headers["x-fake-fault-for"] == "primary"


async def test_the_same_fault_not_aimed_reaches_every_candidate(
    start_sidecar: StartSidecar,
    fake: FakeUpstream,
    fake2: FakeUpstream,
    http: aiohttp.ClientSession,
) -> None:
    """Why the header is needed: without it both candidates fail and the client gets
    the last 503 (backwards compatible: an un-aimed fault applies on every fake)."""
    sc = await start(start_sidecar, fake, fake2)
    async with http.post(sc.proxy_url + CHAT, json={"model": "gpt-4o"}, headers=FAULT) as r:
        assert r.status == 503
        await r.read()
    assert [rec.fault.status for rec in fake.requests] == [503, 503]
    assert [rec.fault.status for rec in fake2.requests] == [503, 503, 503]  # 1 + 2 retries

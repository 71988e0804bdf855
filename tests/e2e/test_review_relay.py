"""Review findings: relay paths the other tests missed, each one a bug found and fixed.

Black-box through the running sidecar. Where an upstream must misbehave in a way
the FakeUpstream cannot (ignore ``Expect``, send a control character in a header),
a tiny raw asyncio server on 127.0.0.1 plays it.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from sidecar.clock import LoopClock
from sidecar.testing import FakeClock, FakeUpstream, Fault
from tests.configs import config, fallback, route, single, upstream
from tests.conftest import StartSidecar, status
from tests.rawhttp import RawUpstream

CHAT = "/v1/chat/completions"
WAIT_S = 5.0


# One upstream ``primary`` with a threshold-1 breaker, one route over it, built by ``single``.
SERVER = {"drain_timeout_ms": 200}
BREAKER = {"failure_threshold": 1, "cooldown_ms": 60000}


def retry(max_retries: int) -> dict[str, int]:
    """The ``[upstreams.primary.retry]`` table: ``max_retries``, 1 ms backoff."""
    return {"max_retries": max_retries, "backoff_initial_ms": 1, "backoff_max_ms": 1}


async def read_head(reader: asyncio.StreamReader) -> dict[str, str]:
    """One request head as lower-case header names -> values."""
    head = await reader.readuntil(b"\r\n\r\n")
    fields = [line.split(":", 1) for line in head.decode("latin-1").split("\r\n")[1:]]
    return {f[0].strip().lower(): f[1].strip() for f in fields if len(f) == 2}


async def test_expect_100_continue_is_not_forwarded_to_an_upstream_that_ignores_it(
    raw_upstream: RawUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """The sidecar already answered the client's ``Expect: 100-continue`` and holds the
    whole body; forwarding the header made aiohttp's client hold the body back until
    the upstream sent ``100 Continue``. An upstream that just waits for the body (RFC
    9110 lets a server ignore Expect) then hung until the first-byte timeout: a 504 and
    a breaker failure for a healthy provider. Envoy strips ``Expect`` the same way.
    """
    seen: list[dict[str, str]] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_head(reader)
        seen.append(head)
        await reader.readexactly(int(head.get("content-length", "0")))  # no 100 Continue
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    url = await raw_upstream(upstream)
    sc = await start_sidecar(
        single(
            url, server=SERVER, retry=retry(0), circuit_breaker=BREAKER, first_byte_timeout_ms=10000
        )
    )
    async with (
        asyncio.timeout(WAIT_S),
        http.post(
            sc.proxy_url + CHAT, data=b'{"model":"m"}', headers={"Expect": "100-continue"}
        ) as r,
    ):
        assert r.status == 200, await r.read()
        assert await r.read() == b"ok"
    assert "expect" not in seen[0]
    assert (await status(http, sc))["primary/*"]["state"] == "closed"


async def test_waiting_for_a_pooled_connection_is_not_a_first_byte_timeout(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession, clock: FakeClock
) -> None:
    """With ``max_connections`` busy (a long stream), the next request waits for a
    connection. That wait ran under ``first_byte_timeout_ms``, so a healthy upstream
    got a 504, a ``timeout`` failure and an open breaker for the sidecar's own pool
    limit, with an attempt counted that never reached it. The wait is now bounded by
    the request deadline only; the first-byte clock starts with a connection.
    """
    fake.script([Fault(stall_after_chunks=2)])
    sc = await start_sidecar(
        single(
            fake.url,
            server=SERVER,
            retry=retry(0),
            circuit_breaker=BREAKER,
            max_connections=1,
            first_byte_timeout_ms=50,
        )
    )
    stream = await http.post(sc.proxy_url + CHAT, json={"model": "m", "stream": True})
    try:
        assert stream.status == 200
        assert await stream.content.readany()  # the first output: the stream now stalls

        queued = asyncio.create_task(http.post(sc.proxy_url + CHAT, json={"model": "m"}))
        # Once it waits for the pool, 10x the first-byte timeout passes on the
        # sidecar's (fake) clock; then a bounded real wait for an answer that must
        # not come.
        assert sc.runtime is not None
        pool = sc.runtime.current.upstreams["primary"].pool
        assert pool is not None
        for _ in range(10_000):  # loop turns, not time
            if pool.waiting:
                break
            await asyncio.sleep(0)
        else:
            raise AssertionError("the second request never waited for the pool")
        clock.advance(0.5)
        done, _ = await asyncio.wait({queued}, timeout=0.5)
        assert not done, "answered while the only connection was busy (first-byte timeout?)"
        assert fake.request_count == 1
        assert (await status(http, sc))["primary/*"]["state"] == "closed"

        fake.release()  # the stream ends: its connection goes back to the pool
        await stream.read()
        async with asyncio.timeout(WAIT_S):
            second = await queued
        assert second.status == 200
        assert second.headers["x-sidecar-attempts"] == "1"
        await second.read()
        second.release()
    finally:
        stream.release()
    entry = (await status(http, sc))["primary/*"]
    assert (entry["state"], entry["last_failure"]) == ("closed", None)


def model_route(url: str) -> str:
    """Route ``smart`` on ``/v1/`` for model ``smart``, rewritten to ``gpt-4o`` on ``primary``."""
    return config(
        upstreams={"primary": upstream(url)},
        routes=[
            route(
                "smart",
                {"upstream": "primary", "model": "gpt-4o"},
                path_prefix="/v1/",
                models=["smart"],
            )
        ],
    )


@pytest.mark.parametrize(
    "rest",
    [
        # JSON.stringify of a JS string cut in the middle of an emoji: a lone surrogate.
        rb'"messages":[{"role":"user","content":"cut \ud83d"}]',
        rb'"logit_scale":1e400',  # valid JSON grammar, beyond a double
    ],
)
async def test_valid_json_that_orjson_refuses_still_routes_and_rewrites_by_model(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession, rest: bytes
) -> None:
    """orjson refuses some valid JSON (RFC 8259's grammar allows any ``\\uXXXX`` escape
    and any exponent). Such a body matched no ``models`` route (400 ``bad_request``) and,
    on a rewriting candidate, went upstream with the client's alias as its model."""
    sc = await start_sidecar(model_route(fake.url))
    body = b'{"model":"smart",' + rest + b"}"
    async with http.post(sc.proxy_url + CHAT, data=body) as r:
        assert r.status == 200, await r.read()
        await r.read()
    assert fake.requests[0].body == b'{"model":"gpt-4o",' + rest + b"}"


async def test_deeply_nested_body_is_rewritten_not_a_500(
    raw_upstream: RawUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """The model rewrite found the ``model`` value by decoding every top-level value
    with the recursive stdlib decoder: a body nested 1000 deep (orjson accepts up to
    1024) raised RecursionError, a bare aiohttp 500 with no ``x-sidecar-*`` headers."""
    received: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_head(reader)
        received.append(await reader.readexactly(int(head["content-length"])))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    sc = await start_sidecar(model_route(await raw_upstream(upstream)))
    nested = b"[" * 1000 + b"]" * 1000
    async with http.post(
        sc.proxy_url + CHAT, data=b'{"model":"smart","deep":' + nested + b',"n":1}'
    ) as r:
        assert r.status == 200, await r.read()
        assert await r.read() == b"ok"
    assert received == [b'{"model":"gpt-4o","deep":' + nested + b',"n":1}']


async def test_upstream_header_with_a_control_character_is_a_broken_response_not_a_500(
    raw_upstream: RawUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """aiohttp's client parser accepts a control character in a response header value;
    its server refuses to send one (header injection guard). The relay then failed in
    ``prepare``: a bare aiohttp 500 with no ``x-sidecar-*`` headers, after the breaker
    had recorded a success. Such an answer is now a broken response before the commit
    point (as Envoy and nginx treat it): retried, counted, 502 when nothing else works.
    """
    answers = [b"X-Bad: a\x01b\r\n", b""]

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_head(reader)
        await reader.readexactly(int(head.get("content-length", "0")))
        extra = answers.pop(0) if answers else b""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + extra + b"\r\nok")
        await writer.drain()
        writer.close()

    sc = await start_sidecar(
        single(await raw_upstream(upstream), server=SERVER, retry=retry(1), circuit_breaker=BREAKER)
    )
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert (r.status, await r.read()) == (200, b"ok")  # the retry got a clean answer
        assert r.headers["x-sidecar-attempts"] == "2"

    answers[:] = [b"X-Bad: a\x7fb\r\n"] * 2
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 502, await r.read()
        assert r.headers["x-sidecar-error"] == "upstream_unavailable"
        assert r.headers["x-sidecar-attempts"] == "2"
    entry = (await status(http, sc))["primary/*"]
    assert (entry["state"], entry["last_failure"]) == ("open", "stream_error")


async def test_retry_after_beyond_the_request_deadline_falls_back_at_once(
    fake: FakeUpstream,
    fake2: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """A ``Retry-After`` under ``retry_after_max_ms`` but longer than what is left of
    ``request_timeout_ms`` was waited out anyway: the deadline ended the request with a
    504 while a healthy backup was never tried. A wait that cannot end before the
    deadline now means "fall back now", like one over ``retry_after_max_ms``.
    (The real clock: the deadline runs on the loop's time; this test takes no longer
    than the fallback.)
    """
    fake.set_default(Fault(status=429, retry_after="20"))
    sc = await start_sidecar(
        fallback(
            fake.url,
            fake2.url,
            server={"request_timeout_ms": 2000},
            primary={"retry": {"max_retries": 2}},
        ),
        clock_=LoopClock(),
    )
    async with http.post(sc.proxy_url + CHAT, json={"model": "m"}) as r:
        assert r.status == 200, await r.read()
        assert r.headers["x-sidecar-upstream"] == "backup"
        assert r.headers["x-sidecar-attempts"] == "2"
        await r.read()
    assert (fake.request_count, fake2.request_count) == (1, 1)

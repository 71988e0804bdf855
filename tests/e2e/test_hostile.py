"""Hostile requests get a clear answer and never reach an upstream.

Every request here goes over a raw asyncio socket to the sidecar's loopback
port, so it can be as malformed as an attacker likes. Each test checks what the
client sees (status, error code, the connection closed where it must be) and
that the fake upstream saw nothing: no request and no connection.
"""

from __future__ import annotations

import pytest

from sidecar.server import Sidecar
from sidecar.testing import FakeUpstream
from tests.configs import config, route, upstream
from tests.conftest import StartSidecar
from tests.rawhttp import RawConn, exchange_then_closed

LIMIT = 1024


@pytest.fixture
async def sc(fake: FakeUpstream, start_sidecar: StartSidecar) -> Sidecar:
    """``/v1/`` routes by the body's model (so it needs JSON); ``/plain/`` relays anything."""
    text = config(
        server={"max_request_body_bytes": LIMIT},
        upstreams={"primary": upstream(fake.url)},
        routes=[
            route("chat", "primary", path_prefix="/v1/", models=["gpt-4o"]),
            route("plain", "primary", path_prefix="/plain/"),
        ],
    )
    return await start_sidecar(text)


def untouched(fake: FakeUpstream) -> None:
    assert fake.request_count == 0
    assert fake.connections_accepted == 0


async def test_control_a_well_formed_raw_request_is_relayed(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    """The harness itself: the same socket code does reach the upstream when the request is fine."""
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(b"GET /plain/x HTTP/1.1\r\nHost: sidecar\r\n\r\n")
        resp = await conn.response()
    assert resp.status == 200
    assert resp.headers["x-sidecar-upstream"] == "primary"
    assert fake.request_count == 1


GET = b"GET /plain/x HTTP/1.1\r\nHost: sidecar\r\n"

PARSER_REFUSALS = {
    "content_length_and_transfer_encoding": (
        b"POST /plain/x HTTP/1.1\r\nHost: sidecar\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        {400},
    ),
    "header_value_over_limit": (GET + b"X-Big: " + b"a" * 9000 + b"\r\n\r\n", {431}),
    "header_block_too_many_fields": (
        GET + b"".join(b"X-H%d: v\r\n" % i for i in range(300)) + b"\r\n",
        {431},
    ),
    "request_line_over_limit": (
        b"GET /plain/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: sidecar\r\n\r\n",
        {431},
    ),
    "cr_in_header_value": (GET + b"X-A: foo\rInjected: 1\r\n\r\n", {400}),
    "lf_in_header_value": (GET + b"X-A: foo\nInjected: 1\r\n\r\n", {400}),
    "nul_in_header_value": (GET + b"X-A: foo\x00bar\r\n\r\n", {400}),
    "obsolete_line_folding": (GET + b"X-A: foo\r\n bar\r\n\r\n", {400}),
    "two_content_lengths": (
        b"POST /plain/x HTTP/1.1\r\nHost: sidecar\r\nContent-Length: 1\r\n"
        b"Content-Length: 2\r\n\r\nab",
        {400},
    ),
    "two_hosts": (GET + b"Host: other\r\n\r\n", {400}),
    "http11_without_host": (b"GET /plain/x HTTP/1.1\r\n\r\n", {400}),
}


@pytest.mark.parametrize("name", sorted(PARSER_REFUSALS))
async def test_parser_refuses_malformed_message_and_closes(
    name: str, sc: Sidecar, fake: FakeUpstream
) -> None:
    """aiohttp's HTTP parser answers these itself (plain text), then closes the connection."""
    data, statuses = PARSER_REFUSALS[name]
    resp = await exchange_then_closed(sc.proxy_port, data)
    assert resp.status in statuses
    untouched(fake)


async def test_body_over_limit_by_content_length_is_413_then_closed(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    """Refused from the Content-Length alone; the body the client still sends is read and
    dropped (aiohttp's lingering close, so the client sees the 413 rather than a reset)."""
    body = b"a" * (LIMIT + 1)
    data = b"POST /plain/x HTTP/1.1\r\nHost: sidecar\r\nContent-Length: %d\r\n\r\n" % len(body)
    resp = await exchange_then_closed(sc.proxy_port, data + body)
    assert resp.status == 413
    assert resp.headers["x-sidecar-error"] == "request_too_large"
    assert resp.json()["error"]["code"] == "request_too_large"
    untouched(fake)


async def test_expect_100_continue_over_the_limit_is_413_at_once(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    """Contract: ``Expect: 100-continue`` with a declared length over the limit is
    answered 413 at once, with no ``100 Continue`` first: the client is never told to
    upload a body that will be refused (curl and the SDKs wait for the interim answer)."""
    head = (
        b"POST /plain/x HTTP/1.1\r\nHost: sidecar\r\nExpect: 100-continue\r\n"
        b"Content-Length: %d\r\n\r\n" % (LIMIT + 1)
    )
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(head)  # no body: a client that waits for 100 Continue
        resp = await conn.response()
    assert resp.status == 413
    assert resp.headers["x-sidecar-error"] == "request_too_large"
    untouched(fake)


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"POST /plain/x HTTP/1.1\r\nHost: a b\r\n", 400),  # an invalid Host
        (b"POST /plain/x HTTP/1.1\r\nHost: sidecar\r\nTransfer-Encoding: gzip, chunked\r\n", 501),
        (b"POST http://evil.example/x HTTP/1.1\r\nHost: sidecar\r\n", 400),  # not a path
    ],
)
async def test_expect_100_continue_is_never_sent_to_a_request_refused_before_its_body(
    sc: Sidecar, fake: FakeUpstream, head: bytes, status: int
) -> None:
    """Any refusal that does not need the body comes first, as the 413 does: a client
    that waits for ``100 Continue`` gets the final answer, never the interim one."""
    length = b"" if b"chunked" in head else b"Content-Length: 10\r\n"
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(head + b"Expect: 100-continue\r\n" + length + b"\r\n")
        resp = await conn.response()
    assert resp.status == status
    untouched(fake)


async def test_expect_100_continue_within_the_limit_gets_100_then_the_answer(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    body = b"a" * LIMIT
    head = (
        b"POST /plain/x HTTP/1.1\r\nHost: sidecar\r\nExpect: 100-continue\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(head)
        interim = await conn.response()
        assert interim.status == 100
        await conn.send(body)
        resp = await conn.response()
    assert resp.status == 200
    assert fake.request_count == 1 and fake.requests[0].body == body


async def test_chunked_body_over_limit_is_413_then_closed(sc: Sidecar, fake: FakeUpstream) -> None:
    """No Content-Length to check up front: the limit is enforced while reading."""
    chunk = b"a" * (LIMIT + 1)
    data = (
        b"POST /plain/x HTTP/1.1\r\nHost: sidecar\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(chunk)
        + chunk
        + b"\r\n0\r\n\r\n"
    )
    resp = await exchange_then_closed(sc.proxy_port, data)
    assert resp.status == 413
    assert resp.headers["x-sidecar-error"] == "request_too_large"
    untouched(fake)


async def test_non_json_body_where_routing_needs_the_model_is_400(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    body = b"model=gpt-4o"
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        resp = await conn.response()
    assert resp.status == 400
    assert resp.headers["x-sidecar-error"] == "bad_request"
    assert resp.json()["error"]["code"] == "bad_request"
    untouched(fake)


async def test_http10_without_host_is_400(sc: Sidecar, fake: FakeUpstream) -> None:
    """Envoy's choice: HTTP/1.0 is served only with a Host (no default host is configured)."""
    resp = await exchange_then_closed(sc.proxy_port, b"GET /plain/x HTTP/1.0\r\n\r\n")
    assert resp.status == 400
    assert resp.headers["x-sidecar-error"] == "bad_request"
    untouched(fake)


async def test_http10_with_host_is_relayed(sc: Sidecar, fake: FakeUpstream) -> None:
    resp = await exchange_then_closed(
        sc.proxy_port, b"GET /plain/x HTTP/1.0\r\nHost: sidecar\r\n\r\n"
    )
    assert resp.status == 200
    assert fake.request_count == 1


@pytest.mark.parametrize("host", [b"evil.example", b"sidecar"])
async def test_absolute_form_target_is_400_not_forwarded(
    host: bytes, sc: Sidecar, fake: FakeUpstream
) -> None:
    """Not an open forward proxy: ``GET http://evil.example/...`` is refused whatever Host says."""
    data = b"GET http://evil.example/plain/x HTTP/1.1\r\nHost: %s\r\n\r\n" % host
    resp = await exchange_then_closed(sc.proxy_port, data)
    assert resp.status == 400
    assert resp.headers["x-sidecar-error"] == "bad_request"
    assert "forward proxy" in resp.json()["error"]["message"]
    untouched(fake)


async def test_absolute_form_on_anthropic_path_gets_anthropic_error_shape(
    sc: Sidecar, fake: FakeUpstream
) -> None:
    data = (
        b"POST http://evil.example/v1/messages HTTP/1.1\r\nHost: sidecar\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    resp = await exchange_then_closed(sc.proxy_port, data)
    assert resp.status == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    untouched(fake)


@pytest.mark.parametrize(
    "data",
    [
        b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\nHost: sidecar\r\n\r\n",
    ],
    ids=["authority_form", "asterisk_form"],
)
async def test_other_non_path_targets_are_refused(
    data: bytes, sc: Sidecar, fake: FakeUpstream
) -> None:
    """aiohttp's router answers 404 for targets that are not paths: never relayed, no tunnel."""
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(data)
        resp = await conn.response()
    assert resp.status in (400, 404)
    untouched(fake)

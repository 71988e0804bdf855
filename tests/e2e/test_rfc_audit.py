"""The relay audited against RFC 9110/9112, nginx and Envoy, with raw bytes on both sides.

A raw client (:class:`tests.rawhttp.RawConn`) sends exactly the bytes under test and reads
exactly what the sidecar answers; a raw upstream (the ``raw_upstream`` fixture, played by
:class:`Upstream`) keeps exactly the bytes the sidecar sends it and answers with exactly the
bytes under test. Nothing between the test and the sidecar normalises what is observed.

``docs/security-and-limits.md`` ("Audit against RFC 9110/9112, nginx and Envoy") lists
every finding; each behaviour it states is asserted here or in the test it names. A
deviation that is a bug is ``xfail(strict=True)`` with the RFC section in its reason: the
test shows the bug today, and fails (XPASS) the day the bug is fixed, so that the marker
and the doc change with the fix.

Every wait is bounded (:data:`tests.rawhttp.WAIT_S`); the only sleeps are the pace of a
deliberately slow client and the zero-length yields of a bounded poll.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import socket
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp.http import SERVER_SOFTWARE

from sidecar.clock import LoopClock
from sidecar.server import Sidecar
from tests.configs import single
from tests.conftest import StartSidecar, metric
from tests.rawhttp import WAIT_S, RawConn, RawUpstream, exchange_then_closed

Fields = list[tuple[bytes, bytes]]

SERVER = {"drain_timeout_ms": 200}
NO_RETRY = {"max_retries": 0}
OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


# -- the raw upstream --------------------------------------------------------------------


@dataclass
class Seen:
    """One request as the upstream received it."""

    line: bytes
    fields: Fields
    """(name, value) in order, as sent: the name's bytes and the value without its OWS."""
    body: bytes


def parse_head(head: bytes) -> tuple[bytes, Fields]:
    """The start line and the fields of a message head (CRLF line ends, blank line included)."""
    line, *rest = head.removesuffix(b"\r\n\r\n").split(b"\r\n")
    fields: Fields = []
    for field in rest:
        name, colon, value = field.partition(b":")
        assert colon, f"not a field line: {field!r}"
        fields.append((name, value.strip(b" \t")))
    return line, fields


def values(fields: Fields, name: bytes) -> list[bytes]:
    """The values of the fields called ``name`` (any case), in order."""
    return [v for n, v in fields if n.lower() == name.lower()]


async def read_request(reader: asyncio.StreamReader) -> Seen:
    """One request off the upstream's socket (the sidecar always frames it by length).

    Reads in plain chunks rather than ``readuntil``, so a head longer than the
    stream's 64 KiB limit is read too.
    """
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = await reader.read(1 << 16)
        if not chunk:
            raise asyncio.IncompleteReadError(buf, None)
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    line, fields = parse_head(head + b"\r\n\r\n")
    assert not values(fields, b"transfer-encoding"), "the sidecar sent a chunked request"
    length = int((values(fields, b"content-length") or [b"0"])[0])
    if len(body) < length:
        body += await reader.readexactly(length - len(body))
    return Seen(line, fields, body)


class Upstream:
    """A raw upstream: keeps every request, answers each with ``parts`` in order.

    A ``bytes`` part is written; an :class:`asyncio.Event` part is waited for first (the
    test decides when the rest comes). The connection stays open for the next request
    unless ``close`` is set (then it is closed after the answer: a FIN).
    """

    def __init__(self, *parts: bytes | asyncio.Event, close: bool = False) -> None:
        self.parts = parts
        self.close = close
        self.requests: list[Seen] = []
        self.connections = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                self.requests.append(await read_request(reader))
                for part in self.parts:
                    if isinstance(part, asyncio.Event):
                        await part.wait()
                    else:
                        writer.write(part)
                        await writer.drain()
                if self.close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def relay_to(
    start_sidecar: StartSidecar,
    raw_upstream: RawUpstream,
    up: Upstream,
    path_prefix: str | None = None,
) -> tuple[Sidecar, str]:
    """A sidecar whose one route (every path, or ``path_prefix``) relays to ``up``; returns
    it and the upstream's ``host:port`` (the ``Host`` the upstream must see)."""
    url = await raw_upstream(up)
    sc = await start_sidecar(
        single(url, server=SERVER, retry=NO_RETRY, route_name="all", path_prefix=path_prefix)
    )
    return sc, url.removeprefix("http://")


# -- the raw client ----------------------------------------------------------------------


@dataclass
class Answer:
    """One response as the client read it."""

    line: bytes
    fields: Fields
    body: bytes
    """The body, de-chunked when it came chunked."""
    raw: bytes
    """Every byte of the response as it came (head and framing included)."""

    @property
    def status(self) -> int:
        return int(self.line.split(b" ")[1])

    def get(self, name: bytes) -> list[bytes]:
        return values(self.fields, name)


async def read_answer(conn: RawConn, *, bodiless: bool = False) -> Answer:
    """One response off the client's socket, framed as RFC 9112 section 6.3 says.

    :param bodiless: the request was a HEAD (no body whatever the fields say).
    """
    reader = conn.reader
    async with asyncio.timeout(WAIT_S):
        head = await reader.readuntil(b"\r\n\r\n")
        line, fields = parse_head(head)
        status = int(line.split(b" ")[1])
        raw, body = head, b""
        if bodiless or status < 200 or status in (204, 304):
            pass
        elif b"chunked" in b",".join(values(fields, b"transfer-encoding")).lower():
            while True:
                size_line = await reader.readuntil(b"\r\n")
                raw += size_line
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                        raw += trailer
                    raw += b"\r\n"
                    break
                data = await reader.readexactly(size + 2)
                raw += data
                body += data[:-2]
        elif lengths := values(fields, b"content-length"):
            body = await reader.readexactly(int(lengths[0]))
            raw += body
        else:
            body = await reader.read()
            raw += body
    return Answer(line, fields, body, raw)


async def one_exchange(port: int, request: bytes, *, bodiless: bool = False) -> Answer:
    """Send ``request`` on a new connection and read its answer."""
    async with await RawConn.open(port) as conn:
        await conn.send(request)
        return await read_answer(conn, bodiless=bodiless)


def post(target: bytes, body: bytes = b"{}", extra: bytes = b"") -> bytes:
    """A raw POST with a ``Content-Length`` body."""
    return b"POST %s HTTP/1.1\r\nHost: sidecar\r\n%sContent-Length: %d\r\n\r\n%s" % (
        target,
        extra,
        len(body),
        body,
    )


async def eventually(predicate: Callable[[], bool]) -> None:
    """Let the loop run until ``predicate()`` holds (at most :data:`WAIT_S`)."""
    async with asyncio.timeout(WAIT_S):
        for _ in itertools.count():
            if predicate():
                return
            await asyncio.sleep(0)


# == request direction =====================================================================


async def test_request_line_and_fields_are_relayed_as_received(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """Method, request-target (percent-encoding, ``%2F``, lower-case hex, dot segments,
    ``//``, path parameters, an invalid ``%zz``, the query), field names' case and order,
    repeated fields apart from each other, empty values and inner whitespace: relayed as
    received. OWS around a value is not part of it (RFC 9110 section 5.5). ``Host`` is the
    upstream's; hop-by-hop fields and the fields ``Connection`` names (``Authorization``
    too) are dropped (RFC 9110 section 7.6.1); ``Max-Forwards``, ``Via``,
    ``X-Forwarded-For`` and ``Forwarded`` pass unchanged, and nothing is added: no ``Via``
    (as nginx and Envoy by default), no ``X-Forwarded-For``, no ``User-Agent``. The body is
    relayed byte for byte with its length."""
    up = Upstream(OK)
    sc, host = await relay_to(start_sidecar, raw_upstream, up)
    target = b"/v1/a%2Fb/%7euser/./x/../y//z;p=1?q=a%20b&q=c+d&e=%zz&empty="
    body = b"\x00\x01 not JSON \xfe\xff"
    kept: Fields = [
        (b"X-lower-UPPER", b"v1"),
        (b"x-rep", b"1"),
        (b"Zeta", b"z"),
        (b"X-Rep", b"2"),
        (b"X-Ws", b"inner  spaces\tand tab"),
        (b"X-Empty", b""),
        (b"Max-Forwards", b"3"),
        (b"Via", b"1.1 client-proxy"),
        (b"X-Forwarded-For", b"10.0.0.1"),
        (b"Forwarded", b"for=10.0.0.1"),
    ]
    request = (
        b"PATCH %s HTTP/1.1\r\n" % target
        + b"hOsT: client.example:8443\r\n"
        + b"X-lower-UPPER: v1\r\nx-rep: 1\r\nZeta: z\r\nX-Rep: 2\r\n"
        + b"X-Ws: \t inner  spaces\tand tab \t\r\n"
        + b"X-Empty:\r\n"
        + b"Connection: X-Named, authorization\r\nx-named: gone\r\nAuthorization: Bearer gone\r\n"
        + b"Keep-Alive: timeout=5\r\nTE: trailers\r\n"
        + b"Max-Forwards: 3\r\nVia: 1.1 client-proxy\r\n"
        + b"X-Forwarded-For: 10.0.0.1\r\nForwarded: for=10.0.0.1\r\n"
        + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    answer = await one_exchange(sc.proxy_port, request)
    assert answer.status == 200
    (seen,) = up.requests
    assert seen.line == b"PATCH %s HTTP/1.1" % target
    assert seen.fields == [
        (b"Host", host.encode()),
        *kept,
        (b"Content-Length", str(len(body)).encode()),
    ]
    assert seen.body == body


@pytest.mark.parametrize(
    ("target", "status"),
    [
        (b"/%76%31/x", 200),
        (b"/v1/./x", 200),
        (b"/v1/a/../b", 200),
        (b"/v1/../admin/x", 400),
        (b"/v1/%2e%2e/admin", 400),
        (b"/v1%2F..%2Fadmin", 400),
        (b"/v1//../admin", 400),
        (b"/admin/../v1/x", 400),
        (b"/admin/../x", 404),
    ],
)
async def test_a_route_confines_the_path_whatever_resolves_its_dot_segments(
    target: bytes, status: int, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A route's ``path_prefix`` is matched against the percent-decoded path, and the
    upstream gets the raw target. A path with dot segments is routed only when every way
    an upstream may read it (as sent; dot segments resolved, RFC 3986 section 5.2.4; ``//``
    merged first; ``%2F`` a separator or not) falls under the same route: ``/v1/./x`` and
    ``/v1/a/../b`` are routed by ``/v1/`` and relayed as received, while ``/v1/../admin/x``
    (which would ride ``/v1/``'s injected key to ``/admin/x``), its encoded forms and
    ``/admin/../v1/x`` get 400 ``bad_request`` and no upstream sees them. nginx routes on
    the resolved, slash-merged path and passes the raw one on; Envoy routes on the raw
    path unless ``normalize_path`` (then it forwards the resolved one). A path with no
    dot segment is matched as decoded (``/%76%31/x`` is ``/v1/x``)."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up, path_prefix="/v1/")
    answer = await one_exchange(sc.proxy_port, b"GET %s HTTP/1.1\r\nHost: s\r\n\r\n" % target)
    assert answer.status == status
    if status == 200:
        assert up.requests[0].line == b"GET %s HTTP/1.1" % target
    else:
        assert up.connections == 0
    if status == 400:
        assert answer.get(b"x-sidecar-error") == [b"bad_request"]


@pytest.mark.parametrize(
    ("request_bytes", "length"),
    [
        (b"GET /v1/models HTTP/1.1\r\nHost: sidecar\r\nContent-Length: 0\r\n\r\n", None),
        (b"POST /v1/x HTTP/1.1\r\nHost: sidecar\r\n\r\n", b"0"),
        (b"DELETE /v1/x HTTP/1.1\r\nHost: sidecar\r\nContent-Length: 2\r\n\r\n{}", b"2"),
    ],
    ids=["get_with_length_0", "post_without_body", "delete_with_body"],
)
async def test_content_length_upstream_follows_rfc_9110_8_6(
    start_sidecar: StartSidecar,
    raw_upstream: RawUpstream,
    request_bytes: bytes,
    length: bytes | None,
) -> None:
    """``Content-Length`` is the client library's (contract): none on a GET without content
    (RFC 9110 section 8.6: SHOULD NOT), ``0`` on a POST without one (SHOULD), the length
    of a DELETE's body. Nothing else is added (no ``Via``, ``User-Agent``, ``Accept``...)."""
    up = Upstream(OK)
    sc, host = await relay_to(start_sidecar, raw_upstream, up)
    assert (await one_exchange(sc.proxy_port, request_bytes)).status == 200
    (seen,) = up.requests
    expected: Fields = [(b"Host", host.encode())]
    if length is not None:
        expected.append((b"Content-Length", length))
    assert seen.fields == expected


async def test_known_field_names_take_aiohttps_spelling_others_keep_theirs(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """Names aiohttp's parser knows (``content-type``, ``USER-AGENT``, ``etag``...) are
    relayed in aiohttp's spelling (``Content-Type``, ``User-Agent``, ``Etag``), both ways;
    other names keep the sender's case. Field names are case-insensitive (RFC 9110
    section 5.1): nginx keeps the sender's case, Envoy lower-cases every name."""
    up = Upstream(
        b'HTTP/1.1 200 OK\r\netag: "x"\r\nCACHE-CONTROL: no-store\r\nx-CamelCase: v\r\n'
        b"content-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
    )
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(
        sc.proxy_port,
        post(
            b"/v1/x", extra=b"content-type: application/json\r\nUSER-AGENT: ua\r\nX-API-KEY: k\r\n"
        ),
    )
    names = [n for n, _ in up.requests[0].fields]
    assert names[1:4] == [b"Content-Type", b"User-Agent", b"X-API-KEY"]
    assert [n for n, _ in answer.fields][:4] == [
        b"Etag",
        b"Cache-Control",
        b"x-CamelCase",
        b"Content-Type",
    ]


async def test_chunked_request_body_is_reframed_with_a_length(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A chunked body is read whole (it must be replayable) and sent with a
    ``Content-Length``; its chunk extensions, its trailer section, ``Trailer`` and ``TE``
    are dropped. This is RFC 9112 section 7.1.3's decoding (length := the data's, remove
    "chunked" and ``Trailer``) and section 7.1.2 lets a recipient that removes the chunked
    coding discard trailers; nginx (with request buffering) and Envoy (trailers
    off on HTTP/1 by default) do the same."""
    up = Upstream(OK)
    sc, host = await relay_to(start_sidecar, raw_upstream, up)
    request = (
        b"POST /v1/x HTTP/1.1\r\nHost: sidecar\r\nTransfer-Encoding: chunked\r\n"
        b"Trailer: X-Sum\r\nTE: trailers\r\nX-Kept: k\r\n\r\n"
        b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 42\r\n\r\n"
    )
    assert (await one_exchange(sc.proxy_port, request)).status == 200
    (seen,) = up.requests
    assert seen.fields == [(b"Host", host.encode()), (b"X-Kept", b"k"), (b"Content-Length", b"5")]
    assert seen.body == b"abcde"


REFUSED = {
    "space_before_colon": b"GET /v1/x HTTP/1.1\r\nHost: s\r\nX-A : v\r\n\r\n",
    "invalid_name_char": b"GET /v1/x HTTP/1.1\r\nHost: s\r\nX@A: v\r\n\r\n",
    "field_without_colon": b"GET /v1/x HTTP/1.1\r\nHost: s\r\nNoColon\r\n\r\n",
    "del_in_value": b"GET /v1/x HTTP/1.1\r\nHost: s\r\nX-A: a\x7fb\r\n\r\n",
    "nul_in_name": b"GET /v1/x HTTP/1.1\r\nHost: s\r\nX\x00A: v\r\n\r\n",
    "bare_cr_line_end": b"GET /v1/x HTTP/1.1\r\nHost: s\rX-A: v\r\n\r\n",
    "bare_lf_line_ends": b"GET /v1/x HTTP/1.1\nHost: s\nX-A: v\n\n",
    "unknown_method": b"FROB /v1/x HTTP/1.1\r\nHost: s\r\n\r\n",
    "lower_case_method": b"get /v1/x HTTP/1.1\r\nHost: s\r\n\r\n",
    "raw_utf8_in_target": b"GET /v1/caf\xc3\xa9 HTTP/1.1\r\nHost: s\r\n\r\n",
    "signed_content_length": b"POST /v1/x HTTP/1.1\r\nHost: s\r\nContent-Length: +2\r\n\r\nab",
    "content_length_list": b"POST /v1/x HTTP/1.1\r\nHost: s\r\nContent-Length: 2, 2\r\n\r\nab",
    "te_identity_and_length": (
        b"POST /v1/x HTTP/1.1\r\nHost: s\r\nTransfer-Encoding: identity\r\n"
        b"Content-Length: 2\r\n\r\nab"
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
async def test_invalid_request_bytes_are_refused_with_400_and_never_relayed(
    name: str, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """Beyond ``tests/e2e/test_hostile.py``'s CR/LF/NUL in values, obs-fold, CL+TE: a space
    before the colon (RFC 9112 section 5.1: MUST 400), a name that is not a token, DEL in a
    value, a bare CR (RFC 9112 section 2.2), bare-LF line ends (a MAY there: nginx accepts
    them), a method the parser does not know (nginx and Envoy relay any token; RFC 9110
    section 9.1 would have an origin answer 501), a lower-case method, raw non-ASCII in the
    target, a signed or listed ``Content-Length`` (RFC 9110 section 8.6 lets a recipient
    refuse ``2, 2``). The parser answers 400, closes, and no upstream sees a connection.
    nginx (``ignore_invalid_headers on``) drops an invalid field name instead."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await exchange_then_closed(sc.proxy_port, REFUSED[name])
    assert answer.status == 400
    assert up.connections == 0


async def test_http_09_request_is_refused_not_relayed(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """An HTTP/0.9 request line (no version) gets the sidecar's 400 (no ``Host``); HTTP/0.9
    is not supported (RFC 9112 section 2.3). Cosmetic: the answer's status line says
    ``HTTP/0.9``."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await exchange_then_closed(sc.proxy_port, b"GET /v1/x\r\n\r\n")
    assert answer.status == 400
    assert up.connections == 0


async def test_upgrade_is_ignored_and_the_connection_stays_http_11(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A server may ignore ``Upgrade`` (RFC 9110 section 7.8): curl's ``Upgrade: h2c`` POST
    is relayed as a plain POST with its body (``Upgrade`` and the ``HTTP2-Settings`` that
    ``Connection`` names dropped); a WebSocket handshake is relayed as a plain GET (its
    end-to-end ``Sec-WebSocket-*`` fields kept), and the connection goes on serving
    HTTP/1.1: a request pipelined behind it is answered. No tunnel is ever opened (nginx
    and Envoy upgrade only what they are configured for)."""
    up = Upstream(OK)
    sc, host = await relay_to(start_sidecar, raw_upstream, up)
    h2c = post(
        b"/v1/x",
        b'{"model":"m"}',
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQ\r\n",
    )
    answer = await one_exchange(sc.proxy_port, h2c)
    assert answer.status == 200
    assert up.requests[0].fields == [(b"Host", host.encode()), (b"Content-Length", b"13")]
    assert up.requests[0].body == b'{"model":"m"}'

    websocket = (
        b"GET /v1/ws HTTP/1.1\r\nHost: sidecar\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(websocket + b"GET /v1/next HTTP/1.1\r\nHost: sidecar\r\n\r\n")
        first, second = await read_answer(conn), await read_answer(conn)
    assert (first.status, second.status) == (200, 200)
    assert up.requests[1].line == b"GET /v1/ws HTTP/1.1"
    assert up.requests[1].fields == [
        (b"Host", host.encode()),
        (b"Sec-WebSocket-Key", b"dGhlIHNhbXBsZSBub25jZQ=="),
        (b"Sec-WebSocket-Version", b"13"),
    ]
    assert up.requests[2].line == b"GET /v1/next HTTP/1.1"


@pytest.mark.parametrize("method", [b"OPTIONS", b"TRACE"])
async def test_max_forwards_is_relayed_not_acted_on(
    method: bytes, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """RFC 9110 section 7.6.2 has an intermediary answer an OPTIONS or TRACE with
    ``Max-Forwards: 0`` itself and decrement the field otherwise. The sidecar, as nginx and
    Envoy, does neither: the request is relayed with the field unchanged. (TRACE is
    relayed too; nginx answers it 405 itself.)"""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    request = b"%s /v1/x HTTP/1.1\r\nHost: sidecar\r\nMax-Forwards: 0\r\n\r\n" % method
    assert (await one_exchange(sc.proxy_port, request)).status == 200
    (seen,) = up.requests
    assert seen.line == b"%s /v1/x HTTP/1.1" % method
    assert values(seen.fields, b"max-forwards") == [b"0"]


async def test_a_fragment_in_the_target_is_dropped_and_the_rest_relayed(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A ``#fragment`` is not part of an origin-form target (RFC 9112 section 3.2); the
    parser drops it and the request is relayed without it (RFC 9112 section 3 would rather
    see a 400 than an autocorrection; Envoy answers 400). Routing and the relay both use
    the target without it, so nothing can be smuggled past a route this way."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    request = b"GET /v1/x?a=1#frag HTTP/1.1\r\nHost: sidecar\r\n\r\n"
    assert (await one_exchange(sc.proxy_port, request)).status == 200
    assert up.requests[0].line == b"GET /v1/x?a=1 HTTP/1.1"


async def test_an_empty_query_is_relayed_as_received(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """``/v1/x?`` reaches the upstream as ``/v1/x?``, the empty query's ``?`` kept (RFC 3986
    section 6.2.3: ``/x?`` and ``/x`` are not equivalent in general; RFC 9112 section 3.2),
    as with nginx and Envoy; a large body (aiohttp's own write path) too."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    await one_exchange(sc.proxy_port, b"GET /v1/x? HTTP/1.1\r\nHost: sidecar\r\n\r\n")
    assert up.requests[0].line == b"GET /v1/x? HTTP/1.1"
    big = b"x" * 100_000
    await one_exchange(sc.proxy_port, post(b"/v1/y?", big))
    assert up.requests[1].line == b"POST /v1/y? HTTP/1.1"
    assert up.requests[1].body == big


@pytest.mark.parametrize("host", [b"other.example:1234", b"", b"127.0.0.1"])
async def test_the_clients_host_is_replaced_by_the_upstreams(
    host: bytes, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """Whatever valid ``Host`` the client sends (another name or port, or the empty value
    RFC 9112 section 3.2 allows), the upstream gets its own (contract)."""
    up = Upstream(OK)
    sc, upstream_host = await relay_to(start_sidecar, raw_upstream, up)
    request = b"GET /v1/x HTTP/1.1\r\nHost: %s\r\n\r\n" % host
    assert (await one_exchange(sc.proxy_port, request)).status == 200
    assert values(up.requests[0].fields, b"host") == [upstream_host.encode()]


@pytest.mark.parametrize("host", [b"a b", b"user@evil.example"], ids=["space", "userinfo"])
async def test_an_invalid_host_is_refused_with_400(
    host: bytes, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A ``Host`` that is not ``uri-host [ ":" port ]`` gets 400 ``bad_request`` and the
    connection is closed (RFC 9112 section 3.2: MUST 400; nginx and Envoy do), although
    its value would be discarded anyway."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, b"GET /v1/x HTTP/1.1\r\nHost: %s\r\n\r\n" % host)
    assert answer.status == 400
    assert up.connections == 0


@pytest.mark.parametrize("body", [None, b"{}", b"x" * 100_000], ids=["none", "small", "large"])
async def test_obs_text_in_a_request_field_is_relayed_byte_for_byte(
    body: bytes | None, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """obs-text (0x80-0xFF that is not UTF-8) and UTF-8 in a field value reach the upstream
    as the client sent them (RFC 9110 section 5.5: opaque data; nginx and Envoy relay it),
    with no body, a small one or one over the inline write's 32 KiB; the other fields, the
    order and the body are unchanged. An ASCII request on the same connection after it is
    relayed as before."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    value = b"caf\xe9 \xc3\xa9 \xff"
    if body is None:
        request = b"GET /v1/x HTTP/1.1\r\nHost: s\r\nX-A: %s\r\nX-B: b\r\n\r\n" % value
    else:
        request = post(b"/v1/x", body, b"X-A: %s\r\nX-B: b\r\n" % value)
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(request)
        assert (await read_answer(conn)).status == 200
        await conn.send(post(b"/v1/y", b"{}", b"X-A: plain\r\n"))
        assert (await read_answer(conn)).status == 200
    first, second = up.requests
    assert values(first.fields, b"x-a") == [value]
    assert values(first.fields, b"x-b") == [b"b"]
    assert first.body == (body or b"")
    assert values(second.fields, b"x-a") == [b"plain"]


async def test_an_unknown_request_transfer_coding_is_refused_with_501(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """``Transfer-Encoding: gzip, chunked``: the parser removes the chunked coding and
    nothing removes gzip, so the body would reach the upstream coded and labelled plain.
    It gets ``501`` unread, the connection closed (RFC 9112 section 6.1: SHOULD 501; nginx
    and Envoy answer 501)."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    coded = gzip.compress(b'{"model":"m"}')
    request = (
        b"POST /v1/x HTTP/1.1\r\nHost: s\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(coded), coded)
    )
    answer = await one_exchange(sc.proxy_port, request)
    assert answer.status == 501
    assert up.connections == 0


async def test_an_http_2_request_line_is_refused(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """An ``HTTP/2.0`` request line in HTTP/1 syntax gets ``505`` in an ``HTTP/1.1`` status
    line (RFC 9110 section 15.6.6; RFC 9112 section 2.3: a server MUST NOT send a version
    it does not conform to), the connection closed; nginx answers 505 too."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(b"GET /v1/x HTTP/2.0\r\nHost: s\r\n\r\n")
        answer = await read_answer(conn)
        assert await conn.closed_by_peer() == b""
    assert answer.status in (400, 505)
    assert answer.line == b"HTTP/1.1 505 HTTP Version Not Supported"
    assert answer.get(b"connection") == [b"close"]
    assert up.connections == 0


LIMITS = {
    "field_line_over_8190": (
        b"GET /v1/x HTTP/1.1\r\nHost: s\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        {431},
    ),
    "over_128_fields": (
        b"GET /v1/x HTTP/1.1\r\nHost: s\r\n"
        + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
        + b"\r\n",
        {431},
    ),
    "request_line_over_8190": (
        b"GET /v1/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: s\r\n\r\n",
        {414, 431},  # the contract says 431
    ),
}


@pytest.mark.parametrize("name", sorted(LIMITS))
async def test_a_head_over_the_parsers_limits_gets_431_or_414(
    name: str, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A field line or a request line over 8190 bytes, or more than 128 fields: ``431``
    (the contract's table of error answers, RFC 6585 section 5), the connection closed,
    no upstream connection. The contract says 431 for a request line too, where RFC 9112
    section 3 would have 414 (nginx answers 414, Envoy 431)."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    data, statuses = LIMITS[name]
    answer = await exchange_then_closed(sc.proxy_port, data)
    assert answer.status in statuses
    assert up.connections == 0


async def test_the_head_has_no_total_size_limit_below_the_per_line_ones(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """Limits are per line (8190 bytes) and per count (128 fields): a 104 KB head of 13
    fields of 8000 bytes is accepted and relayed byte for byte. nginx refuses a head over
    its ``large_client_header_buffers`` (4 x 8 KiB) and Envoy one over
    ``max_request_headers_kb`` (60 KiB, 431)."""
    up = Upstream(OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    big: Fields = [(b"X-Big-%d" % i, b"%d" % (i % 10) * 8000) for i in range(13)]
    head = b"".join(b"%s: %s\r\n" % f for f in big)
    assert len(head) > 100_000
    request = b"GET /v1/x HTTP/1.1\r\nHost: s\r\n" + head + b"\r\n"
    assert (await one_exchange(sc.proxy_port, request)).status == 200
    assert up.requests[0].fields[1:] == big


# == response direction ====================================================================


FRAMINGS = ["length", "chunked"]
"""How an answer's body is framed: a ``Content-Length`` answer whose body comes with its
head takes the relay's whole-answer write (``sidecar.whole_answer``), a chunked one the
streaming pump (``sidecar.wire.push_pump``)."""


def framed(head: bytes, body: bytes, framing: str) -> bytes:
    """An answer: ``head`` (status line and fields, no blank line) and ``body``, framed."""
    if framing == "length":
        return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    chunked = b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
    return head + chunked % (len(body), body)


@pytest.mark.parametrize(
    "status_line",
    [b"200 Totally Fine", b"404 OK", b"299 Whatever", b"201 ", b"418 I'm a teapot"],
)
@pytest.mark.parametrize("framing", FRAMINGS)
async def test_status_line_reason_phrase_is_relayed_as_is(
    status_line: bytes, framing: str, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """The reason phrase is the upstream's, however odd or empty (as nginx; Envoy writes its
    own standard phrase). The version is the sidecar's own (RFC 9110 section 6.2), here
    for an HTTP/1.0 upstream."""
    head = b"HTTP/1.0 %s\r\nContent-Type: text/plain\r\n" % status_line
    up = Upstream(framed(head, b"ok", framing))
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.line == b"HTTP/1.1 %s" % status_line
    assert answer.body == b"ok"


async def test_a_missing_reason_phrase_gets_its_separator(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """``HTTP/1.1 200`` (no SP, which llhttp tolerates) goes out as ``HTTP/1.1 200 `` with an
    empty reason, the status-line grammar's form (RFC 9112 section 4)."""
    up = Upstream(b"HTTP/1.1 200\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.line == b"HTTP/1.1 200 "
    assert answer.body == b"ok"


RESPONSE_FIELDS: Fields = [
    (b"x-CamelCase", b"v"),
    (b"Set-Cookie", b"a=1; Path=/"),
    (b"Z-Last", b"z"),
    (b"Set-Cookie", b"b=2"),
    (b"A-First", b"a"),
    (b"Date", b"Mon, 01 Jan 2001 00:00:00 GMT"),
    (b"Server", b"upstream/1.0"),
    (b"Content-Type", b"text/plain"),
]


@pytest.mark.parametrize("framing", FRAMINGS)
async def test_response_fields_keep_order_case_duplicates_date_and_server(
    framing: str, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """The upstream's end-to-end fields come first, in its order and case, ``Set-Cookie``
    repeated apart from each other; its ``Date`` and ``Server`` are relayed, not replaced
    (nginx replaces both by default, Envoy overwrites ``Server``). Then the sidecar's
    ``x-sidecar-upstream`` / ``x-sidecar-attempts``, then (chunked) its own framing."""
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"%s: %s\r\n" % f for f in RESPONSE_FIELDS)
    up = Upstream(framed(head, b"ok", framing))
    end_to_end = [*RESPONSE_FIELDS]
    if framing == "length":
        end_to_end.append((b"Content-Length", b"2"))
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    n = len(end_to_end)
    assert answer.fields[:n] == end_to_end
    assert answer.fields[n : n + 2] == [
        (b"x-sidecar-upstream", b"primary"),
        (b"x-sidecar-attempts", b"1"),
    ]
    assert answer.get(b"date") == [b"Mon, 01 Jan 2001 00:00:00 GMT"]
    assert answer.get(b"server") == [b"upstream/1.0"]
    assert answer.body == b"ok"


async def test_date_and_server_are_added_when_the_upstream_sent_none(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A recipient with a clock adds ``Date`` to a response it forwards without one (RFC 9110
    section 6.6.1: MUST). ``Server`` is added too, naming Python and aiohttp with their
    versions (nginx names itself and its version by default, Envoy says ``envoy``; RFC 9110
    section 10.2.4 advises against needless detail). A 200 with an empty body is relayed
    as it came: no ``Content-Type`` is added to it."""
    up = Upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.status == 200
    (date,) = answer.get(b"date")
    assert date.endswith(b" GMT") and len(date) == 29  # IMF-fixdate
    assert answer.get(b"server") == [SERVER_SOFTWARE.encode()]
    assert answer.get(b"content-type") == []
    assert answer.get(b"content-length") == [b"0"]


@pytest.mark.parametrize("framing", FRAMINGS)
async def test_no_content_type_is_added_to_an_unlabelled_body(
    framing: str, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """An answer with content and no ``Content-Type`` is relayed without one (RFC 9110
    section 8.3: its recipient may sniff it; a proxy does not label it; nginx and Envoy
    add nothing), for a whole answer and a streamed one; aiohttp would add
    ``application/octet-stream``."""
    up = Upstream(framed(b"HTTP/1.1 200 OK\r\n", b"ok", framing))
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.body == b"ok"
    assert answer.get(b"content-type") == []


async def test_obs_fold_from_the_upstream_is_replaced_by_spaces(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """RFC 9112 section 5.2 lets a proxy either answer 502 or replace each obs-fold with SP
    before forwarding; the sidecar does the latter (nginx and Envoy answer 502)."""
    up = Upstream(
        b"HTTP/1.1 200 OK\r\nX-Fold: a\r\n  b\r\n"
        b"Content-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
    )
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.status == 200
    (folded,) = answer.get(b"x-fold")
    assert folded.split() == [b"a", b"b"]
    assert b"\r" not in folded and b"\n" not in folded


@pytest.mark.parametrize("framing", FRAMINGS)
async def test_obs_text_in_a_response_field_is_relayed_byte_for_byte(
    framing: str, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """obs-text and UTF-8 in an upstream field value reach the client as they came (RFC
    9110 section 5.5), for a whole answer and a streamed one alike; the rest of the head
    and the body are unchanged."""
    value = b"caf\xe9 \xc3\xa9 \xff"
    up = Upstream(
        framed(
            b"HTTP/1.1 200 OK\r\nX-T: %s\r\nContent-Type: text/plain\r\n" % value, b"ok", framing
        )
    )
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.get(b"x-t") == [value]
    assert answer.get(b"content-type") == [b"text/plain"]
    assert answer.get(b"x-sidecar-upstream") == [b"primary"]
    assert answer.body == b"ok"


async def test_interim_1xx_answers_are_dropped_and_the_final_one_relayed_intact(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A ``103 Early Hints`` and an unsolicited ``100 Continue`` from the upstream are not
    forwarded (RFC 9110 section 15.2 says a proxy MUST forward 1xx it did not ask for; nginx
    by default and Envoy on HTTP/1 drop them too); the final answer arrives alone, with
    its own fields only (the 103's ``Link`` is not merged into it)."""
    up = Upstream(
        b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Final: 1\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok",
    )
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.raw.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.get(b"x-final") == [b"1"]
    assert answer.get(b"link") == []
    assert answer.body == b"ok"


async def test_an_unsolicited_101_is_a_broken_response(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A ``101 Switching Protocols`` to a request that asked for no upgrade (the sidecar
    never sends ``Upgrade``) is a broken response: 502 ``upstream_unavailable``, the
    upstream connection closed (RFC 9110 section 15.2.2: a server MUST NOT switch to a
    protocol the client did not ask for)."""
    up = Upstream(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nraw"
    )
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.status == 502
    assert answer.get(b"x-sidecar-error") == [b"upstream_unavailable"]


BODILESS = {
    "204_with_length_0": (
        b"POST",
        b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX-A: a\r\n\r\n",
    ),
    "204_chunked": (
        b"POST",
        b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\nX-A: a\r\n\r\n",
    ),
    "304_with_length": (
        b"GET",
        b'HTTP/1.1 304 Not Modified\r\nETag: "x"\r\nContent-Length: 10\r\nX-A: a\r\n\r\n',
    ),
    "head_with_length": (b"HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\nX-A: a\r\n\r\n"),
}


@pytest.mark.parametrize("name", sorted(BODILESS))
async def test_bodiless_answers_keep_their_framing(
    name: str, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """A 204 goes out with neither ``Content-Length`` nor ``Transfer-Encoding`` (RFC 9110
    section 8.6 and RFC 9112 section 6.1: MUST NOT); a 304 loses its ``Content-Length``
    (allowed there, RFC 9110 section 8.6, but aiohttp removes it: harmless); a HEAD
    answer keeps the ``Content-Length`` of the GET it describes (RFC 9110 section 9.3.2)
    and has no body. The next request on the connection is framed right."""
    method, head = BODILESS[name]
    up = Upstream(head)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    request = b"%s /v1/x HTTP/1.1\r\nHost: s\r\n\r\n" % method
    async with await RawConn.open(sc.proxy_port) as conn:
        for _ in range(2):  # the second answer proves the first was framed right
            await conn.send(request)
            answer = await read_answer(conn, bodiless=method == b"HEAD")
            assert answer.body == b""
            assert answer.get(b"x-a") == [b"a"]
            assert answer.get(b"transfer-encoding") == []
            expected_length = [b"1234"] if method == b"HEAD" else []
            assert answer.get(b"content-length") == expected_length
    assert len(up.requests) == 2


@pytest.mark.parametrize(
    ("answer_bytes", "status", "body"),
    [
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello", 204, b""),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nokEXTRA",
            200,
            b"ok",
        ),
    ],
    ids=["204_with_a_body", "more_than_content_length"],
)
async def test_bytes_after_a_complete_answer_do_not_break_it(
    answer_bytes: bytes,
    status: int,
    body: bytes,
    start_sidecar: StartSidecar,
    raw_upstream: RawUpstream,
) -> None:
    """Bytes after a complete answer in the same read (a 204 with a body, more bytes than
    ``Content-Length``): the answer is relayed as its framing delimits it, once (no
    retry), the bytes after it are discarded, never relayed nor taken for the next
    answer, and the upstream connection is not reused (RFC 9112 section 6.3: a client
    MUST NOT process or forward such data as a separate response; nginx and Envoy relay
    the answer and drop the connection)."""
    up = Upstream(answer_bytes)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    async with await RawConn.open(sc.proxy_port) as conn:
        for n in (1, 2):
            await conn.send(post(b"/v1/x"))
            answer = await read_answer(conn)
            assert answer.status == status
            assert answer.body == body
            assert b"hello" not in answer.raw and b"EXTRA" not in answer.raw
            assert answer.get(b"x-sidecar-attempts") == [b"1"]
            await eventually(lambda n=n: up.connections == n)  # type: ignore[misc]  # a new one each
    assert len(up.requests) == 2


async def test_a_body_shorter_than_its_content_length_is_a_cut(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """The upstream's ``Content-Length`` is relayed; when its body ends short (a FIN after 4
    of 10 bytes) the client gets those 4 bytes and the connection is cut: never a complete
    answer, never a connection kept for another request (RFC 9112 section 8)."""
    fin = asyncio.Event()  # the FIN comes once the client has the first bytes
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 10\r\n\r\n"
    up = Upstream(head + b"abcd", fin, close=True)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(post(b"/v1/x"))
        async with asyncio.timeout(WAIT_S):
            got = await conn.reader.readuntil(b"\r\n\r\n")
            first = await conn.reader.readexactly(4)
        fin.set()
        rest = await conn.closed_by_peer()
    assert b"\r\nContent-Length: 10\r\n" in got
    assert (first, rest) == (b"abcd", b"")


async def test_chunk_extensions_and_trailers_are_not_relayed(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """The answer is re-chunked by the sidecar: the data is relayed, the upstream's chunk
    extensions, its trailer section and its ``Trailer`` field are not (RFC 9112 section
    7.1.2 lets a recipient discard trailers; nginx and Envoy on HTTP/1 drop them too)."""
    up = Upstream(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTrailer: X-Sum\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        b"3;name=val\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 42\r\n\r\n"
    )
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.body == b"abcde"
    assert answer.get(b"trailer") == []
    assert b"name=val" not in answer.raw
    assert b"X-Sum" not in answer.raw
    assert answer.raw.endswith(b"\r\n0\r\n\r\n")


async def test_an_unknown_response_transfer_coding_is_not_relayed_as_plain(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """``Transfer-Encoding: gzip, chunked`` from the upstream: aiohttp removes the chunked
    coding only, and a transfer coding is hop-by-hop (RFC 9112 sections 6.1 and 7), so
    relaying the rest would hand the client gzip bytes labelled plain. It is a broken
    response: 502 ``upstream_unavailable`` (nginx and Envoy answer 502)."""
    coded = gzip.compress(b"hello world")
    up = Upstream(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(coded), coded)
    )
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.status == 502 or answer.body == b"hello world"
    assert answer.get(b"x-sidecar-error") == [b"upstream_unavailable"]


@pytest.mark.parametrize(
    "answer_bytes",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nokk",
    ],
    ids=["length_and_chunked", "two_lengths"],
)
async def test_an_answer_with_ambiguous_framing_is_a_502(
    answer_bytes: bytes, start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """RFC 9112 section 6.3: a response whose framing is invalid is discarded and the proxy
    answers 502 (nginx and Envoy do); the sidecar's own ``upstream_unavailable``."""
    up = Upstream(answer_bytes)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    answer = await one_exchange(sc.proxy_port, post(b"/v1/x"))
    assert answer.status == 502
    assert answer.get(b"x-sidecar-error") == [b"upstream_unavailable"]


# == client-side timeouts ====================================================================

READ_TIMEOUT_MS = 500


async def test_a_body_dribbled_byte_by_byte_is_cut_at_client_read_timeout_ms(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream
) -> None:
    """``client_read_timeout_ms`` bounds the whole body, not the gap between two reads: a
    body sent one byte per 50 ms (steady progress) is cut at the deadline with 400 and the
    connection closed. nginx's ``client_body_timeout`` (60 s) bounds each gap only, so it
    would take such a body; Envoy's ``request_timeout`` (off by default) bounds the whole.
    Real time: the client's pace is what is under test."""
    up = Upstream(OK)
    url = await raw_upstream(up)
    sc = await start_sidecar(
        single(url, server={**SERVER, "client_read_timeout_ms": READ_TIMEOUT_MS}, retry=NO_RETRY),
        clock_=LoopClock(),
    )
    body = b'{"model":"m","pad":"' + b"p" * 400 + b'"}'
    loop = asyncio.get_running_loop()
    async with await RawConn.open(sc.proxy_port) as conn:
        await conn.send(b"POST /v1/x HTTP/1.1\r\nHost: s\r\nContent-Length: %d\r\n\r\n" % len(body))
        started = loop.time()
        reading = asyncio.create_task(conn.closed_by_peer())
        sent = 0
        while sent < len(body) and not reading.done():
            await conn.send(body[sent : sent + 1])
            sent += 1
            await asyncio.wait({reading}, timeout=0.05)  # the client's pace
        answer = await reading
        elapsed = loop.time() - started
    assert sent < len(body), "the whole body got through"
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"in time" in answer
    assert READ_TIMEOUT_MS / 1000 * 0.9 <= elapsed < READ_TIMEOUT_MS / 1000 + 2.0
    assert up.connections == 0


async def test_a_client_that_stops_reading_a_stream_is_cut_after_idle_timeout_ms(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream, http: aiohttp.ClientSession
) -> None:
    """There is no send timeout of its own: when the client stops reading, the relay stops
    reading the upstream (backpressure), no chunk is relayed, and the upstream's
    ``idle_timeout_ms`` (the longest gap between relayed chunks) cuts the stream: the client
    connection is aborted and the upstream connection closed. nginx's ``send_timeout``
    (60 s between two writes) and Envoy's ``stream_idle_timeout`` (5 min, which also
    covers a peer that opens no window) do this job. The cut is counted as
    ``sidecar_stream_aborts_total{reason="idle_timeout"}``: a stalled client looks like a
    stalled upstream there (no breaker effect: it is after the commit point)."""
    event = b'data: {"choices":[{"delta":{"content":"' + b"x" * 4000 + b'"}}]}\n\n'
    chunk = b"%x\r\n%s\r\n" % (len(event), event)
    cut = asyncio.Event()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        try:
            while True:  # as fast as the sidecar takes it
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            cut.set()
        finally:
            writer.close()

    idle_ms = 300
    url = await raw_upstream(upstream)
    sc = await start_sidecar(
        single(url, server=SERVER, retry=NO_RETRY, idle_timeout_ms=idle_ms), clock_=LoopClock()
    )
    # A client that reads nothing, with a small receive window: the relay's writes stall.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", sc.proxy_port))
    _reader, writer = await asyncio.open_connection(sock=sock)
    # The registry is the process's: count from what earlier tests left.
    before = await metric(
        http, sc, "sidecar_stream_aborts_total", upstream="primary", reason="idle_timeout"
    )
    try:  # ``_reader`` is never read: past its limit it stops reading the socket itself
        writer.write(post(b"/v1/chat/completions", b'{"model":"m","stream":true}'))
        await writer.drain()
        started = loop.time()
        async with asyncio.timeout(WAIT_S):
            await cut.wait()
        assert loop.time() - started >= idle_ms / 1000 * 0.9
        connections = sc.connections
        assert connections is not None
        await eventually(lambda: connections.open_connections == 0)
        aborts = await metric(
            http, sc, "sidecar_stream_aborts_total", upstream="primary", reason="idle_timeout"
        )
        assert aborts == before + 1
    finally:
        writer.transport.abort()


async def test_a_client_that_half_closes_after_its_request_is_taken_as_gone(
    start_sidecar: StartSidecar, raw_upstream: RawUpstream, http: aiohttp.ClientSession
) -> None:
    """A client that shuts down its sending side after a complete request (a FIN) is taken
    as gone: the connection is closed with no answer and the request counted as 499, as
    nginx does (499, "client prematurely closed connection", unless
    ``proxy_ignore_client_abort``) and Envoy does (half-close is off on HTTP connections)."""
    gate = asyncio.Event()  # the upstream holds its answer until the test ends
    up = Upstream(gate, OK)
    sc, _ = await relay_to(start_sidecar, raw_upstream, up)
    try:
        # The registry is the process's: count from what earlier tests left.
        before = await metric(http, sc, "sidecar_requests_total", route="all", code="499")
        async with await RawConn.open(sc.proxy_port) as conn:
            await conn.send(post(b"/v1/x"))
            conn.writer.write_eof()
            assert await conn.closed_by_peer() == b""
        async with asyncio.timeout(WAIT_S):  # counted when the cancelled handler has ended
            while (
                await metric(http, sc, "sidecar_requests_total", route="all", code="499")
                != before + 1
            ):
                pass
    finally:
        gate.set()

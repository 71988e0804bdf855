"""Header hygiene for the relay, both ways (pure functions, no IO).

Rules (contract, "The proxy port" / Headers):

* Hop-by-hop headers are dropped both ways: ``Connection``, ``Keep-Alive``,
  ``Proxy-Connection``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``
  and every header named in ``Connection`` (RFC 9110 section 7.6.1), plus the
  proxy's own ``Proxy-Authorization`` / ``Proxy-Authenticate``.
* ``Host`` is the upstream's (aiohttp's client sets it from the URL, so the
  client's ``Host`` is dropped here). ``Expect`` is dropped on the way up (the
  sidecar answers ``100-continue`` itself, as Envoy does).
* ``Content-Length`` is dropped on the way up (the client library sets it from
  the possibly rewritten body) and kept on the way down (the body bytes are
  relayed unchanged, so the length still holds and a truncated body stays
  detectable by the client); ``Transfer-Encoding`` is re-applied by the server.
* With an ``api_key_env`` upstream, every credential header the client sent
  (``Authorization``, ``x-api-key``, ``api-key``) is dropped and the configured
  auth header set: ``authorization`` gets ``Bearer <key>``, any other name the
  raw key.
* ``Content-Encoding`` passes through untouched; nothing adds
  ``Accept-Encoding``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from multidict import CIMultiDict, istr

HOP_BY_HOP: frozenset[str] = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
    }
)
"""Lower-case names dropped in both directions (RFC 9110 s. 7.6.1 and proxy auth)."""

CREDENTIAL_HEADERS: frozenset[str] = frozenset({"authorization", "x-api-key", "api-key"})
"""Client credential headers replaced when the upstream injects its own key."""

REQUEST_DROP: frozenset[str] = HOP_BY_HOP | {"host", "content-length", "expect"}
"""Also ``Expect``: the sidecar's server already answered ``100-continue`` and holds the
whole body; forwarded, it would make the client wait for an upstream ``100 Continue``
that a server may never send (RFC 9110 s. 10.1.1), until the first-byte timeout."""
RESPONSE_DROP: frozenset[str] = HOP_BY_HOP

SIDECAR_UPSTREAM = istr("x-sidecar-upstream")
SIDECAR_ATTEMPTS = istr("x-sidecar-attempts")
SIDECAR_ERROR = istr("x-sidecar-error")


def connection_tokens(values: Iterable[str]) -> set[str]:
    """Header names listed in ``Connection`` values (lower-cased, RFC 9110 s. 7.6.1)."""
    names: set[str] = set()
    for value in values:
        for token in value.split(","):
            token = token.strip().lower()
            if token:
                names.add(token)
    return names


def _connection_values(headers: Mapping[str, str] | CIMultiDict[str]) -> list[str]:
    """The values of every ``Connection`` header (names in any case)."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall("connection", ())) if "connection" in headers else []
    return [v for k, v in headers.items() if k.lower() == "connection"]


class RequestHeaderRule(NamedTuple):
    """One upstream's request-header rule, built once: what to drop, what to add."""

    drop: frozenset[str]
    """Lower-case names dropped from the client's headers."""
    add: tuple[tuple[str, str], ...]
    """Headers set on every request: the configured ``headers``, then the auth header."""


def request_header_rule(
    *, extra: Mapping[str, str], auth_header: str, api_key: str | None
) -> RequestHeaderRule:
    """The rule of :func:`upstream_request_headers` for one upstream's settings."""
    auth = auth_header.lower()
    added = {name.lower(): (name, value) for name, value in extra.items()}
    drop = REQUEST_DROP | set(added)
    if api_key is not None:
        drop |= CREDENTIAL_HEADERS | {auth}
        added[auth] = (auth_header, f"Bearer {api_key}" if auth == "authorization" else api_key)
    return RequestHeaderRule(frozenset(drop), tuple(added.values()))


def request_header_pairs(
    client_headers: Mapping[str, str] | CIMultiDict[str], rule: RequestHeaderRule
) -> list[tuple[str, str]]:
    """The headers sent upstream as (name, value) pairs (aiohttp's client takes them as
    they are: no intermediate header map is built)."""
    drop = rule.drop
    conn = _connection_values(client_headers)
    if conn:
        drop = drop | connection_tokens(conn)
    out = [(k, v) for k, v in client_headers.items() if k.lower() not in drop]
    out.extend(rule.add)
    return out


def upstream_request_headers(
    client_headers: Mapping[str, str] | CIMultiDict[str],
    *,
    extra: Mapping[str, str],
    auth_header: str,
    api_key: str | None,
) -> CIMultiDict[str]:
    """Build the headers sent upstream from the client's request headers.

    :param client_headers: the client's headers (multi-valued, any case).
    :param extra: the upstream's configured ``headers``, set (replacing) on
        every request.
    :param auth_header: the configured auth header name (lower-case).
    :param api_key: the key from ``api_key_env``, or ``None`` to pass the
        client's credentials through.
    :returns: a new :class:`CIMultiDict`; the input is not modified.
    """
    rule = request_header_rule(extra=extra, auth_header=auth_header, api_key=api_key)
    return CIMultiDict(request_header_pairs(client_headers, rule))


def client_response_headers(
    upstream_headers: Mapping[str, str] | CIMultiDict[str], *, upstream: str, attempts: int
) -> CIMultiDict[str]:
    """Build the headers relayed to the client from an upstream response.

    Drops hop-by-hop headers; keeps ``Content-Length``, ``Content-Encoding`` and every
    end-to-end header (``Set-Cookie`` duplicates included); adds
    ``x-sidecar-upstream`` (upstream name) and ``x-sidecar-attempts`` (count of
    every upstream attempt made for this request).
    """
    out: CIMultiDict[str] = CIMultiDict()
    copy_response_headers(upstream_headers, out, upstream, attempts)
    return out


def copy_response_headers(
    upstream_headers: Mapping[str, str] | CIMultiDict[str],
    into: CIMultiDict[str],
    upstream: str,
    attempts: int,
) -> None:
    """Add the headers relayed to the client (see :func:`client_response_headers`) to
    ``into``, the response's own header map (no intermediate map is built)."""
    drop = RESPONSE_DROP
    conn = _connection_values(upstream_headers)
    if conn:
        drop = drop | connection_tokens(conn)
    into.extend([(k, v) for k, v in upstream_headers.items() if k.lower() not in drop])
    into[SIDECAR_UPSTREAM] = upstream
    into[SIDECAR_ATTEMPTS] = str(attempts)

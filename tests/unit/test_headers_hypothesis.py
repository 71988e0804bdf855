"""Generated header sets against the header rules (sidecar.headers), both ways.

Invariants (contract, "The proxy port" / Headers):

* no hop-by-hop header survives, nor any header the ``Connection`` header names;
* no ``Host`` and no ``Content-Length`` go up (the client library sets both), and
  no ``Expect`` (the sidecar answers ``100-continue`` itself and holds the whole
  body, as Envoy does: docs/design-choices.md);
* with an injected key, no client credential header survives and the configured
  auth header is set exactly once, to the configured key;
* without one, the client's credentials pass through;
* every other end-to-end header passes through with all its values, in order;
* on the way down, ``x-sidecar-upstream`` / ``x-sidecar-attempts`` are set once.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from sidecar.headers import client_response_headers, upstream_request_headers

# The contract's lists, written out here (not imported) so that the test checks them.
HOP_BY_HOP = frozenset(
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
CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})
REQUEST_ONLY_DROP = frozenset({"host", "content-length", "expect"})
"""Dropped on the way up only; on the way down they are end-to-end headers like any other."""
SIDECAR_UPSTREAM = "x-sidecar-upstream"
SIDECAR_ATTEMPTS = "x-sidecar-attempts"

SPECIAL = sorted(
    HOP_BY_HOP
    | CREDENTIAL_HEADERS
    | REQUEST_ONLY_DROP
    | {"content-encoding", "set-cookie", "x-sidecar-upstream"}
)
PLAIN = ["x-request-id", "openai-organization", "anthropic-version", "accept", "x-custom-key"]
TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)


@st.composite
def any_case(draw: st.DrawFn, name: str) -> str:
    """``name`` with each letter in a drawn case."""
    flips = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    return "".join(c.upper() if f else c for c, f in zip(name, flips, strict=True))


NAMES = st.one_of(st.sampled_from(SPECIAL), st.sampled_from(PLAIN), TOKEN).flatmap(any_case)
VALUES = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=0, max_size=20
)


@st.composite
def connection_value(draw: st.DrawFn) -> str:
    """A ``Connection`` value: a comma list of names, with stray spaces and empty items."""
    names = draw(st.lists(NAMES, max_size=4))
    seps = draw(st.lists(st.sampled_from([",", ", ", " ,", ",,", " , "]), min_size=len(names)))
    return "".join(n + s for n, s in zip(names, seps, strict=False)).strip(", ") or "close"


@st.composite
def header_sets(draw: st.DrawFn) -> CIMultiDict[str]:
    """A multi-valued header set with any names in any case, and maybe ``Connection`` lines."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in draw(st.lists(st.tuples(NAMES, VALUES), max_size=14)):
        out.add(name, value)
    for _ in range(draw(st.integers(0, 2))):
        out.add(
            draw(st.sampled_from(["Connection", "connection", "CONNECTION"])),
            draw(connection_value()),
        )
    return out


def named_in_connection(headers: CIMultiDict[str]) -> set[str]:
    """Reference: the lower-case names listed in every Connection value."""
    return {
        t.strip().lower()
        for v in headers.getall("connection", [])
        for t in v.split(",")
        if t.strip()
    }


def lower_names(headers: CIMultiDict[str]) -> set[str]:
    return {k.lower() for k in headers}


EXTRA = st.dictionaries(st.sampled_from(["x-conf-team", "x-conf-env"]), VALUES, max_size=2)
AUTH = st.sampled_from(["authorization", "x-api-key", "api-key", "x-custom-key"])
KEYS = st.one_of(st.none(), st.text(alphabet="abcdefABCDEF0123456789-_", min_size=1, max_size=30))


@settings(max_examples=200, deadline=None)
@given(client=header_sets(), extra=EXTRA, auth=AUTH, key=KEYS)
def test_upstream_request_headers_invariants(
    client: CIMultiDict[str], extra: dict[str, str], auth: str, key: str | None
) -> None:
    before = CIMultiDict(client)
    out = upstream_request_headers(client, extra=extra, auth_header=auth, api_key=key)
    assert client == before, "the input must not be modified"
    names = lower_names(out)
    conn = named_in_connection(client)

    assert not names & HOP_BY_HOP
    assert not (names & conn) - set(extra) - ({auth} if key is not None else set())
    assert not names & REQUEST_ONLY_DROP
    for name, value in extra.items():
        assert out.getall(name) == [value]

    if key is not None:
        assert out.getall(auth) == [f"Bearer {key}" if auth == "authorization" else key]
        assert not (names & CREDENTIAL_HEADERS) - {auth}
    else:
        for cred in CREDENTIAL_HEADERS - conn:
            assert out.getall(cred, []) == client.getall(cred, [])

    dropped = HOP_BY_HOP | REQUEST_ONLY_DROP | conn | set(extra)
    if key is not None:
        dropped |= CREDENTIAL_HEADERS | {auth}
    for name in lower_names(client) - dropped:
        assert out.getall(name) == client.getall(name), name


@settings(max_examples=200, deadline=None)
@given(
    upstream_headers=header_sets(),
    name=st.sampled_from(["primary", "backup"]),
    attempts=st.integers(0, 50),
)
def test_client_response_headers_invariants(
    upstream_headers: CIMultiDict[str], name: str, attempts: int
) -> None:
    out = client_response_headers(upstream_headers, upstream=name, attempts=attempts)
    names = lower_names(out)
    conn = named_in_connection(upstream_headers)
    ours = {SIDECAR_UPSTREAM, SIDECAR_ATTEMPTS}

    assert not names & HOP_BY_HOP
    assert not (names & conn) - ours
    assert out.getall(SIDECAR_UPSTREAM) == [name]
    assert out.getall(SIDECAR_ATTEMPTS) == [str(attempts)]
    for kept in lower_names(upstream_headers) - HOP_BY_HOP - conn - ours:
        assert out.getall(kept) == upstream_headers.getall(kept), kept


def test_configured_header_replaces_the_clients() -> None:
    client: CIMultiDict[str] = CIMultiDict([("X-Team", "red"), ("x-team", "green")])
    out = upstream_request_headers(
        client, extra={"x-team": "blue"}, auth_header="authorization", api_key=None
    )
    assert out.getall("x-team") == ["blue"]


def test_hop_by_hop_named_in_connection_is_dropped_even_when_end_to_end_looking() -> None:
    client: CIMultiDict[str] = CIMultiDict(
        [("Connection", "X-Secret-Hop, keep-alive"), ("X-Secret-Hop", "1"), ("X-Keep", "2")]
    )
    out = upstream_request_headers(client, extra={}, auth_header="authorization", api_key=None)
    assert list(out.items()) == [("X-Keep", "2")]

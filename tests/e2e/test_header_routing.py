"""Routes that match on request headers (``match_headers``): validation and precedence.

Contract ("Route resolution"): a route's ``match_headers`` must all match (names in
any letter case, ``"*"`` = present, any other value = equal exactly); longest
prefix first, then more conditions (``models`` and ``match_headers`` count one
each) before fewer, then file order. Every route has its own upstream name (all
on one fake), so ``x-sidecar-upstream`` tells which route won.
"""

from __future__ import annotations

import json

import aiohttp
import pytest

from sidecar.config import ConfigError, parse_config, render_effective
from sidecar.testing import FakeUpstream
from tests.configs import route_table
from tests.conftest import StartSidecar

# (name; its upstream is "up_" + name), prefix, models, match_headers
HRoute = tuple[str, str, list[str] | None, dict[str, str] | None]


TABLE: list[HRoute] = [
    ("plain", "/v1/", None, None),
    ("tenant", "/v1/", None, {"X-Tenant": "blue"}),  # exact value; declared in mixed case
    ("anthropic", "/v1/", None, {"anthropic-version": "*"}),
    ("anthropic_smart", "/v1/", ["smart"], {"anthropic-version": "*"}),  # two conditions
    ("smart", "/v1/", ["smart"], None),
    ("both", "/v1/", None, {"x-tenant": "blue", "x-env": "prod"}),  # one condition
    ("chat", "/v1/chat/", None, None),  # a longer prefix beats any number of conditions
]


@pytest.mark.parametrize(
    ("path", "headers", "model", "winner"),
    [
        ("/v1/models", {}, None, "plain"),
        ("/v1/models", {"x-tenant": "blue"}, None, "tenant"),
        ("/v1/models", {"X-TENANT": "blue"}, None, "tenant"),  # any letter case
        ("/v1/models", {"x-tenant": "Blue"}, None, "plain"),  # values are exact
        ("/v1/models", {"x-tenant": "blue "}, None, "tenant"),  # OWS is not part of a value
        ("/v1/models", {"x-tenant": ""}, None, "plain"),
        ("/v1/models", {"anthropic-version": "2023-06-01"}, None, "anthropic"),
        ("/v1/models", {"Anthropic-Version": ""}, None, "anthropic"),  # present, even empty
        ("/v1/x", {"anthropic-version": "2023-06-01"}, "smart", "anthropic_smart"),
        ("/v1/x", {}, "smart", "smart"),
        ("/v1/x", {"anthropic-version": "1"}, "other", "anthropic"),
        # equal prefix and one condition each: file order ("tenant" before "both")
        ("/v1/x", {"x-tenant": "blue", "x-env": "prod"}, None, "tenant"),
        ("/v1/chat/completions", {"anthropic-version": "1"}, "smart", "chat"),
    ],
)
async def test_header_route_resolution(
    fake: FakeUpstream,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    path: str,
    headers: dict[str, str],
    model: str | None,
    winner: str,
) -> None:
    sc = await start_sidecar(route_table(fake.url, TABLE))
    body = json.dumps({"model": model} if model else {"input": "x"}).encode()
    async with http.post(sc.proxy_url + path, data=body, headers=headers) as r:
        assert r.status == 200
        assert r.headers["x-sidecar-upstream"] == f"up_{winner}"
        await r.read()
    assert fake.request_count == 1
    for name, value in headers.items():  # the matched headers are relayed as they came
        assert fake.requests[0].headers.getall(name) == [value.strip()]


async def test_more_conditions_win_whatever_the_file_order(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    table: list[HRoute] = [
        ("plain", "/v1/", None, None),
        ("one", "/v1/", None, {"x-a": "*"}),
        ("two", "/v1/", ["m"], {"x-a": "*"}),
    ]
    for order in (table, table[::-1]):
        sc = await start_sidecar(route_table(fake.url, order))
        for headers, model, winner in (
            ({"x-a": "1"}, "m", "two"),
            ({"x-a": "1"}, "n", "one"),
            ({}, "m", "plain"),
        ):
            async with http.post(
                sc.proxy_url + "/v1/x", json={"model": model}, headers=headers
            ) as r:
                assert r.headers["x-sidecar-upstream"] == f"up_{winner}"


async def test_no_route_when_the_headers_do_not_match(
    fake: FakeUpstream, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sc = await start_sidecar(route_table(fake.url, [("only", "/v1/", ["m"], {"x-a": "1"})]))
    # The only route here needs x-a: 1; without it no route applies, so a body
    # without a model is not the caller's mistake but a missing route.
    for headers, body in (({}, b"not json"), ({"x-a": "2"}, b'{"model": "m"}')):
        async with http.post(sc.proxy_url + "/v1/x", data=body, headers=headers) as r:
            assert r.status == 404
            assert r.headers["x-sidecar-error"] == "no_route"
    async with http.post(sc.proxy_url + "/v1/x", data=b"not json", headers={"x-a": "1"}) as r:
        assert r.status == 400
        assert r.headers["x-sidecar-error"] == "bad_request"
    assert fake.request_count == 0


BASE = """
[upstreams.a]
base_url = "http://127.0.0.1:1"
[[routes]]
name = "r"
candidates = [{ upstream = "a" }]
"""


def route_errors(line: str) -> list[str]:
    text = BASE.replace('name = "r"', f'name = "r"\n{line}')
    with pytest.raises(ConfigError) as exc:
        parse_config(text, {})
    return exc.value.errors


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            'match_headers = { "bad name" = "*" }',
            'routes[0].match_headers."bad name": must be a valid HTTP header name',
        ),
        (
            'match_headers = { "x:y" = "*" }',
            'routes[0].match_headers."x:y": must be a valid HTTP header name',
        ),
        (
            'match_headers = { "" = "*" }',
            'routes[0].match_headers."": must be a valid HTTP header name',
        ),
        (
            'match_headers = { X-A = "1", x-a = "2" }',
            "routes[0].match_headers.x-a: duplicate header name (names are case-insensitive)",
        ),
        (
            'match_headers = { x-a = "a\\nb" }',
            "routes[0].match_headers.x-a: header value must not contain CR, LF or NUL",
        ),
        (
            'match_headers = { x-a = " a" }',
            "routes[0].match_headers.x-a: "
            "must not start or end with whitespace (it could never match)",
        ),
        (
            "match_headers = { x-a = 1 }",
            "routes[0].match_headers.x-a: expected a string, got an integer",
        ),
        ('match_headers = "x-a"', "routes[0].match_headers: expected a table, got a string"),
    ],
)
def test_match_headers_validation(line: str, expected: str) -> None:
    assert route_errors(line) == [expected]


def test_match_headers_names_are_lower_cased_and_round_trip() -> None:
    text = BASE.replace('name = "r"', 'name = "r"\nmatch_headers = { "Anthropic-Version" = "*" }')
    c = parse_config(text, {})
    assert c.routes[0].match_headers == {"anthropic-version": "*"}
    assert parse_config(render_effective(c), {}) == c
    assert parse_config(BASE, {}).routes[0].match_headers == {}

"""Config keys of the tier chooser (interface.md, "Configuration", "Choosing among
candidates"): tier, weight, balance, affinity_header, affinity_ttl_ms; errors name
their key path."""

from __future__ import annotations

import pytest

from sidecar.config import ConfigError, parse_config, render_effective
from sidecar.routes import RouteTable

BASE = """
[upstreams.key_a]
base_url = "https://api.openai.com"
[upstreams.key_b]
base_url = "https://api.openai.com"
[upstreams.backup]
base_url = "http://127.0.0.1:8001"

[[routes]]
name = "pool"
path_prefix = "/v1/"
{route}
candidates = [{candidates}]
"""

TIERED = (
    '{ upstream = "key_a", model = "gpt-4o", tier = 0, weight = 2 }, '
    '{ upstream = "key_b", model = "gpt-4o", tier = 0 }, { upstream = "backup", tier = 1 }'
)


def text(candidates: str = TIERED, route: str = "") -> str:
    return BASE.format(candidates=candidates, route=route)


def errors_of(t: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(t, {})
    return exc.value.errors


def test_the_contracts_example_compiles_to_tiers() -> None:
    c = parse_config(text(route='affinity_header = "X-Session-Id"'), {})
    (route,) = RouteTable(c).routes
    assert route.tiers is not None
    assert [[m.upstream for m in t] for t in route.tiers] == [["key_a", "key_b"], ["backup"]]
    assert [m.weight for m in route.tiers[0]] == [2.0, 1.0]
    assert (route.balance, route.affinity_header, route.affinity_ttl_s) == (
        "least_loaded",
        "x-session-id",
        3600.0,
    )
    assert {t.upstream for t in route.first_tier} == {"key_a", "key_b"}
    assert parse_config(render_effective(c), {}) == c


def test_a_route_without_tiers_is_an_ordered_list() -> None:
    c = parse_config(text('{ upstream = "key_a" }, { upstream = "backup" }'), {})
    (route,) = RouteTable(c).routes
    assert route.tiers is None


@pytest.mark.parametrize(
    ("candidates", "route", "errors"),
    [
        (
            '{ upstream = "key_a", tier = 0 }, { upstream = "backup" }',
            "",
            [
                "routes[0].candidates[1].tier: is required: candidates[0] sets a tier, "
                "so every candidate of this route must"
            ],
        ),
        (
            '{ upstream = "key_a", tier = 0 }, { upstream = "key_a", tier = 1 }',
            "",
            [
                "routes[0].candidates[1]: the same upstream and model as candidates[0]: "
                "a tier's members are distinct targets"
            ],
        ),
        (
            '{ upstream = "key_a", tier = -1 }',
            "",
            ["routes[0].candidates[0].tier: must be >= 0"],
        ),
        (
            '{ upstream = "key_a", tier = 0, weight = 0 }',
            "",
            ["routes[0].candidates[0].weight: expected `float` > 0.0"],
        ),
        (TIERED, 'balance = "random"', None),
        (
            '{ upstream = "key_a" }',
            'affinity_header = "x-session-id"',
            [
                "routes[0].affinity_header: needs candidates with a tier: sessions keep "
                "to one member of a tier"
            ],
        ),
        (
            TIERED,
            'affinity_header = "x session"',
            ["routes[0].affinity_header: must be an HTTP header name"],
        ),
        (TIERED, "affinity_ttl_ms = 0", ["routes[0].affinity_ttl_ms: must be > 0"]),
    ],
)
def test_errors_name_their_key_path(candidates: str, route: str, errors: list[str] | None) -> None:
    got = errors_of(text(candidates, route))
    if errors is None:
        assert len(got) == 1 and got[0].startswith("routes[0].balance: ")
        assert "least_loaded" in got[0]
    else:
        assert got == errors

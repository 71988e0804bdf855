"""check-config's blind spots (issue 23, item 6): hints on unknown keys, the tables an
environment override creates, and the warnings of :mod:`sidecar.config.lint`.

The unreachable-route tables are also checked against the router itself
(:class:`sidecar.routes.RouteTable`): a route the lint flags is never chosen for any
request that matches it, and every route it does not flag is chosen for one.
"""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from sidecar.config import ConfigError, parse_config, parse_config_with_warnings
from sidecar.routes import RouteTable
from tests.configs import config, route, upstream

URL = "http://127.0.0.1:1"


def errors_of(text: str, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, environ or {})
    return exc.value.errors


def warnings_of(text: str, environ: dict[str, str] | None = None) -> list[str]:
    return [f"{k}: {m}" for k, m in parse_config_with_warnings(text, environ or {}).warnings]


TWO = config(
    upstreams={"primary": upstream(URL), "backup": upstream(URL)},
    routes=[route("chat", "primary", "backup", path_prefix="/v1/")],
)

# ---- unknown keys: the nearest name, and where secrets go -------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            '[upstreams.primary]\napi_key = "sk-proj-0123456789abcdef"',
            'upstreams.primary.api_key: unknown key; did you mean "api_key_env"? (secrets '
            "never go in the config file, only in the environment: set api_key_env to the "
            "NAME of the variable that holds it)",
        ),
        (  # an Anthropic key under any name: the value gives it away
            '[upstreams.primary]\nanthropic = "sk-ant-api03-0123456789"',
            "upstreams.primary.anthropic: unknown key (secrets never go in the config file, "
            "only in the environment: set api_key_env to the NAME of the variable that holds it)",
        ),
        (  # a variable's name is not a secret: the name hint only
            '[upstreams.primary]\napi_key_en = "OPENAI_API_KEY"',
            'upstreams.primary.api_key_en: unknown key; did you mean "api_key_env"?',
        ),
        (
            "[upstreams.primary]\nmax_retries = 5",
            'upstreams.primary.max_retries: unknown key; did you mean "retry.max_retries"?',
        ),
        (
            '[upstreams.primary]\nbase_ulr = "http://127.0.0.1:2"',
            'upstreams.primary.base_ulr: unknown key; did you mean "base_url"?',
        ),
        (
            "[upstreams.primary.circuit_breaker]\ncooldown = 1000",
            'upstreams.primary.circuit_breaker.cooldown: unknown key; did you mean "cooldown_ms"?',
        ),
        (
            "[upstreams.primary.retry]\nstatus = [503]",
            'upstreams.primary.retry.status: unknown key; did you mean "statuses"?',
        ),
        (
            '[server]\nlisten_addr = "127.0.0.1:1"',
            'server.listen_addr: unknown key; did you mean "listen"?',
        ),
        (
            '[fleet]\nredis_url = "redis://user:pw@127.0.0.1:6379/0"',
            'fleet.redis_url: unknown key; did you mean "redis_url_env"? (secrets never go in '
            "the config file, only in the environment: set redis_url_env to the NAME of the "
            "variable that holds it)",
        ),
        (  # a table with no variable to name: the rule only
            '[upstreams.primary.retry]\ntoken = "abc123def456"',
            "upstreams.primary.retry.token: unknown key (secrets never go in the config file, "
            "only in the environment)",
        ),
        (  # [server] has admin_token_env (the admin port's token): the hint names it
            '[server]\ntoken = "abc123def456"',
            "server.token: unknown key (secrets never go in the config file, only in the "
            "environment: set admin_token_env to the NAME of the variable that holds it)",
        ),
        (
            '[upstream.primary]\nbase_url = "http://127.0.0.1:2"',
            'upstream: unknown key; did you mean "upstreams"?',
        ),
        ("[server]\nbogus = 1", "server.bogus: unknown key"),  # nothing near: no hint
    ],
)
def test_an_unknown_key_gets_a_hint(extra: str, expected: str) -> None:
    assert errors_of(
        config(upstreams={"primary": upstream(URL)}, routes=[route("chat", "primary")], extra=extra)
    ) == [expected]


def test_a_candidate_key_typo_gets_a_hint() -> None:
    text = config(
        upstreams={"primary": upstream(URL)},
        routes=[route("chat", {"upstream": "primary", "modle": "gpt-4o"})],
    )
    assert errors_of(text) == ['routes[0].candidates[0].modle: unknown key; did you mean "model"?']


def test_the_secret_is_never_echoed() -> None:
    secret = "sk-proj-never-echoed-0123456789"
    text = config(
        upstreams={"primary": upstream(URL, api_key=secret)}, routes=[route("c", "primary")]
    )
    errs = errors_of(text)
    assert len(errs) == 1 and "api_key_env" in errs[0]
    assert secret not in "\n".join(errs)


# ---- the environment: an override that creates a table ----------------------------------


def test_a_typo_in_an_upstream_name_from_the_environment_is_a_warning_naming_it() -> None:
    env = {"SIDECAR__UPSTREAMS__PRIMRY__BASE_URL": "http://127.0.0.1:9"}
    loaded = parse_config_with_warnings(TWO, env)
    assert loaded.config.upstreams["primary"].base_url == URL  # the intended key is untouched
    assert warnings_of(TWO, env) == [
        "upstreams.primry: no route uses this upstream, which is not in the config file: "
        'SIDECAR__UPSTREAMS__PRIMRY__BASE_URL created it; did you mean "primary" '
        "(SIDECAR__UPSTREAMS__PRIMARY__BASE_URL)?"
    ]


def test_a_whole_upstream_table_from_the_environment_unused_is_a_warning() -> None:
    env = {"sidecar__upstreams__bakup": '{ base_url = "http://127.0.0.1:9" }'}
    assert warnings_of(TWO, env) == [
        "upstreams.bakup: no route uses this upstream, which is not in the config file: "
        'sidecar__upstreams__bakup created it; did you mean "backup" '
        "(SIDECAR__UPSTREAMS__BACKUP)?"
    ]


def test_an_upstream_only_the_environment_defines_and_a_route_uses_is_fine() -> None:
    """Documented and tested (test_config.py, test_env_override_creates_tables): the
    environment may define an upstream; used by a route, it draws no warning."""
    text = config(
        upstreams={"primary": upstream(URL)},
        routes=[route("chat", "primary", "extra", path_prefix="/v1/")],
    )
    env = {
        "SIDECAR__UPSTREAMS__EXTRA__BASE_URL": "http://127.0.0.1:9",
        "SIDECAR__UPSTREAMS__EXTRA__API_KEY_ENV": "EXTRA_KEY",
    }
    loaded = parse_config_with_warnings(text, env)
    assert loaded.config.upstreams["extra"].api_key_env == "EXTRA_KEY"
    assert loaded.warnings == []


def test_an_error_inside_a_table_the_environment_created_names_the_variable() -> None:
    env = {"SIDECAR__UPSTREAMS__PRIMRY__API_KEY_ENV": "KEY"}
    assert errors_of(TWO, env) == [
        "upstreams.primry.base_url: required key is missing (upstreams.primry is not in the "
        "config file: SIDECAR__UPSTREAMS__PRIMRY__API_KEY_ENV created it; did you mean "
        '"primary" (SIDECAR__UPSTREAMS__PRIMARY__API_KEY_ENV)?)'
    ]
    assert errors_of(TWO, {"SIDECAR__UPSTREAM__PRIMARY__BASE_URL": URL}) == [
        # One hint, the note's: it names the variable to set instead.
        "upstream: unknown key (upstream is not in the config "
        'file: SIDECAR__UPSTREAM__PRIMARY__BASE_URL created it; did you mean "upstreams" '
        "(SIDECAR__UPSTREAMS__PRIMARY__BASE_URL)?)"
    ]


@pytest.mark.parametrize(
    ("name", "warned"),
    [
        ("SIDECAR_UPSTREAMS__PRIMARY__BASE_URL", True),  # one underscore: ignored, say so
        ("sidecar_routes__0__path_prefix", True),
        ("SIDECAR_CONFIG", False),  # the config path variable
        ("SIDECAR_REDIS_URL", False),  # a variable named by a key
        ("SIDECAR__SERVER__LOG_LEVEL", False),  # a real override
    ],
)
def test_a_near_miss_of_the_override_prefix_is_a_warning(name: str, warned: bool) -> None:
    value = "debug" if name.endswith("LOG_LEVEL") else "x"
    got = warnings_of(TWO, {name: value})
    expected = [f"{name}: ignored: an override starts with SIDECAR__ (two underscores)"]
    assert got == (expected if warned else [])


def test_an_override_of_a_key_the_file_has_creates_nothing() -> None:
    env = {
        "SIDECAR__UPSTREAMS__PRIMARY__BASE_URL": "http://127.0.0.1:9",
        "SIDECAR__UPSTREAMS__PRIMARY__CIRCUIT_BREAKER__COOLDOWN_MS": "1000",  # a new sub-table
    }
    loaded = parse_config_with_warnings(TWO, env)
    assert loaded.config.upstreams["primary"].base_url == "http://127.0.0.1:9"
    assert loaded.warnings == []


# ---- an upstream no route uses -----------------------------------------------------------


def test_an_upstream_no_route_uses_is_a_warning() -> None:
    text = config(
        upstreams={"primary": upstream(URL), "backup": upstream(URL), "spare": upstream(URL)},
        routes=[route("chat", "primary"), route("embed", "backup", path_prefix="/v1/embeddings")],
    )
    assert warnings_of(text) == ["upstreams.spare: no route uses this upstream"]
    assert warnings_of(TWO) == []


# ---- a route no request can reach --------------------------------------------------------

Row = tuple[list[dict[str, Any]], list[str]]
"""(routes, the warnings expected), each route as ``route()`` keywords over ``primary``."""

UNREACHABLE: list[tuple[str, Row]] = [
    (
        "the same prefix, no conditions",
        (
            [{"name": "a", "path_prefix": "/v1/"}, {"name": "b", "path_prefix": "/v1/"}],
            [
                'routes[1]: no request can reach route "b": routes[0] ("a") has the same '
                "path_prefix, is tried before it and takes every request it matches"
            ],
        ),
    ),
    (
        "a longer prefix later in the file is tried first: both reachable",
        ([{"name": "a", "path_prefix": "/v1/"}, {"name": "b", "path_prefix": "/v1/chat/"}], []),
    ),
    (
        "a shorter prefix later in the file is reachable",
        ([{"name": "a", "path_prefix": "/v1/chat/"}, {"name": "b", "path_prefix": "/v1/"}], []),
    ),
    (
        "more conditions are tried first, whatever the file order",
        (
            [
                {"name": "any", "path_prefix": "/v1/"},
                {"name": "gpt", "path_prefix": "/v1/", "models": ["gpt-4o"]},
            ],
            [],
        ),
    ),
    (
        "the same models",
        (
            [
                {"name": "a", "models": ["gpt-4o", "o3"]},
                {"name": "b", "models": ["o3"]},
            ],
            [
                'routes[1]: no request can reach route "b": routes[0] ("a") has the same '
                "path_prefix, is tried before it and takes every request it matches"
            ],
        ),
    ),
    (
        "two routes before it list every model it lists",
        (
            [
                {"name": "a", "models": ["gpt-4o"]},
                {"name": "b", "models": ["o3"]},
                {"name": "c", "models": ["o3", "gpt-4o"]},
            ],
            [
                'routes[2]: no request can reach route "c": routes[0] ("a"), routes[1] ("b") '
                "have the same path_prefix, are tried before it and take every request it matches"
            ],
        ),
    ),
    (
        "a model no route before it lists",
        ([{"name": "a", "models": ["gpt-4o"]}, {"name": "b", "models": ["gpt-4o", "o3"]}], []),
    ),
    (
        "a header condition it does not have",
        (
            [
                {"name": "a", "match_headers": {"x-team": "blue"}},
                {"name": "b", "match_headers": {"x-env": "prod"}},
            ],
            [],
        ),
    ),
    (
        "present (*) is implied by an exact value of the same header",
        (
            [
                {"name": "any_version", "match_headers": {"anthropic-version": "*"}},
                {"name": "one_version", "match_headers": {"anthropic-version": "2023-06-01"}},
            ],
            [
                'routes[1]: no request can reach route "one_version": routes[0] ("any_version") '
                "has the same path_prefix, is tried before it and takes every request it matches"
            ],
        ),
    ),
    (
        "an exact value is not implied by present (*)",
        (
            [
                {"name": "one_version", "match_headers": {"anthropic-version": "2023-06-01"}},
                {"name": "any_version", "match_headers": {"anthropic-version": "*"}},
            ],
            [],
        ),
    ),
    (
        "headers and models: the route with both is tried first",
        (
            [
                {"name": "hdr", "match_headers": {"x-team": "blue"}},
                {"name": "both", "models": ["o3"], "match_headers": {"x-team": "blue"}},
            ],
            [],
        ),
    ),
    (
        "a catch-all with the same header shadows a route with more headers only at an "
        "equal count of conditions",
        (
            [
                {"name": "blue", "match_headers": {"x-team": "blue"}},
                {"name": "blue_prod", "match_headers": {"x-team": "blue", "x-env": "prod"}},
            ],
            [
                'routes[1]: no request can reach route "blue_prod": routes[0] ("blue") has the '
                "same path_prefix, is tried before it and takes every request it matches"
            ],
        ),
    ),
    (
        "the embedded default's three routes",
        (
            [
                {"name": "messages", "path_prefix": "/v1/messages"},
                {
                    "name": "anthropic",
                    "path_prefix": "/v1/",
                    "match_headers": {"anthropic-version": "*"},
                },
                {"name": "openai", "path_prefix": "/v1/"},
            ],
            [],
        ),
    ),
]


def _probes(r: dict[str, Any], every_model: set[str]) -> list[tuple[str, CIMultiDict[str], bytes]]:
    """Requests that match route ``r``: its own prefix as the path (no longer prefix
    matches it), its headers (``*``: a value no route names), and each model it lists
    (no ``models``: no model, and every model named)."""
    path = r.get("path_prefix", "/")
    headers = CIMultiDict(
        {k: ("any-value" if v == "*" else v) for k, v in r.get("match_headers", {}).items()}
    )
    models = r.get("models") or [None, *sorted(every_model)]
    return [(path, headers, b"{}" if m is None else f'{{"model": "{m}"}}'.encode()) for m in models]


@pytest.mark.parametrize(
    ("rows", "expected"), [row for _, row in UNREACHABLE], ids=[i for i, _ in UNREACHABLE]
)
def test_a_route_no_request_can_reach_is_a_warning(
    rows: list[dict[str, Any]], expected: list[str]
) -> None:
    text = config(
        upstreams={"primary": upstream(URL)},
        routes=[
            route(r["name"], "primary", **{k: v for k, v in r.items() if k != "name"}) for r in rows
        ],
    )
    loaded = parse_config_with_warnings(text, {})
    assert [f"{k}: {m}" for k, m in loaded.warnings] == expected
    # The router agrees: a flagged route is never chosen for a request it matches; every
    # other route is chosen for one of them.
    table = RouteTable(loaded.config)
    flagged = {int(w.split("]")[0].removeprefix("routes[")) for w in expected}
    every_model = {m for r in rows for m in r.get("models", [])}
    for i, r in enumerate(rows):
        chosen = {
            got.name if (got := table.resolve(p, h, b)) else None
            for p, h, b in _probes(r, every_model)
        }
        if i in flagged:
            assert r["name"] not in chosen, (r, chosen)
        else:
            assert r["name"] in chosen, (r, chosen)

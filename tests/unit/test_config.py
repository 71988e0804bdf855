"""Tests for sidecar.config: the default, every validation rule, env overrides, rendering."""

import importlib.resources
from pathlib import Path

import pytest

from sidecar import config as config_mod
from sidecar.config import (
    DEFAULT_CONFIG_PATH,
    BreakerConfig,
    CandidateConfig,
    Config,
    ConfigError,
    RetryConfig,
    ServerConfig,
    load_config,
    missing_api_key_envs,
    parse_config,
    render_effective,
    resolve_config_path,
    split_host_port,
)

BASE = """
[upstreams.openai]
base_url = "https://api.openai.com"

[upstreams.backup]
base_url = "http://backup.internal:8000/v1base"

[[routes]]
name = "chat"
path_prefix = "/v1/"
candidates = [{ upstream = "openai" }, { upstream = "backup" }]
"""

FULL = """
[server]
listen = "127.0.0.1:8080"
admin_listen = "0.0.0.0:9090"
max_request_body_bytes = 33554432
request_timeout_ms = 600000
drain_timeout_ms = 25000
max_concurrent_requests = 1024
client_read_timeout_ms = 30000
log_level = "info"

[upstreams.openai]
base_url = "https://api.openai.com"
api_key_env = "OPENAI_API_KEY"
auth_header = "authorization"
headers = { }
connect_timeout_ms = 5000
first_byte_timeout_ms = 60000
idle_timeout_ms = 120000
max_connections = 256
max_response_header_bytes = 65536

[upstreams.openai.retry]
max_retries = 2
backoff_initial_ms = 250
backoff_max_ms = 2000
retry_after_max_ms = 60000
statuses = [408, 429, 500, 502, 503, 504, 529]
retry_on_timeout = false

[upstreams.openai.circuit_breaker]
failure_threshold = 3
cooldown_ms = 30000
half_open_max_probes = 1
success_threshold = 1
failure_statuses = [408, 429, 500, 501, 502, 503, 504, 529]

[upstreams.backup]
base_url = "https://backup.example.com/"

[[routes]]
name = "chat"
path_prefix = "/v1/"
models = ["gpt-4o", "smart"]
candidates = [
  { upstream = "openai", model = "gpt-4o" },
  { upstream = "backup" },
]
"""


def errors_of(text: str, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, environ or {})
    assert str(exc.value) == "\n".join(exc.value.errors)
    return exc.value.errors


# ---- the embedded default and good configs -----------------------------------------


def test_default_loads_clean() -> None:
    c = load_config(None, {})
    assert list(c.upstreams) == ["openai", "anthropic"]
    assert c.upstreams["openai"].base_url == "https://api.openai.com"
    assert c.upstreams["anthropic"].base_url == "https://api.anthropic.com"
    for up in c.upstreams.values():
        assert up.circuit_breaker == BreakerConfig()
        assert up.api_key_env is None
        assert up.retry == RetryConfig()
    assert c.upstreams["anthropic"].auth_header == "x-api-key"
    assert c.upstreams["openai"].auth_header == "authorization"
    assert [(r.name, r.path_prefix, r.match_headers) for r in c.routes] == [
        ("anthropic", "/v1/messages", {}),
        ("anthropic_sdk", "/v1/", {"anthropic-version": "*"}),
        ("openai", "/v1/", {}),
    ]
    assert c.routes[0].candidates == (CandidateConfig(upstream="anthropic"),)
    assert c.routes[1].candidates == (CandidateConfig(upstream="anthropic"),)
    assert c.routes[2].candidates == (CandidateConfig(upstream="openai"),)
    assert c.server == ServerConfig()
    assert missing_api_key_envs(c, {}) == []


def test_default_is_packaged_resource() -> None:
    text = importlib.resources.files("sidecar").joinpath("default.toml").read_text("utf-8")
    assert parse_config(text, {}) == load_config(None, {})


def test_contract_example_loads() -> None:
    c = parse_config(FULL, {})
    up = c.upstreams["openai"]
    assert up.api_key_env == "OPENAI_API_KEY"
    assert up.circuit_breaker == BreakerConfig()
    assert up.connect_timeout_s == 5.0 and up.first_byte_timeout_s == 60.0
    assert up.idle_timeout_s == 120.0
    assert c.server.request_timeout_s == 600.0 and c.server.drain_timeout_s == 25.0
    assert c.server.client_read_timeout_s == 30.0
    assert up.circuit_breaker is not None and up.circuit_breaker.cooldown_s == 30.0
    assert c.routes[0].models == frozenset({"gpt-4o", "smart"})
    assert c.routes[0].candidates[0] == CandidateConfig(upstream="openai", model="gpt-4o")
    assert c.upstreams["backup"].base_url == "https://backup.example.com"  # trailing / dropped
    assert c.upstreams["backup"].circuit_breaker is None
    assert c.upstreams["backup"].retry == RetryConfig()


def test_minimal_config_takes_defaults() -> None:
    c = parse_config(BASE, {})
    assert c.server == ServerConfig()
    assert c.routes[0].models is None
    assert c.upstreams["openai"].headers == {}
    assert c.upstreams["openai"].auth_header == "authorization"


def test_edge_values_accepted() -> None:
    extra = """
[server]
listen = "[::1]:0"
admin_listen = "localhost:65535"
[upstreams.openai.retry]
max_retries = 0
retry_after_max_ms = 0
statuses = []
[upstreams.x1]
base_url = "HTTP://10.0.0.1:8000/prefix"
auth_header = "X-Api-Key"
"""
    c = parse_config(BASE + extra, {})
    assert c.upstreams["openai"].retry.max_retries == 0
    assert c.upstreams["x1"].auth_header == "x-api-key"
    assert split_host_port(c.server.listen) == ("::1", 0)


# ---- validation: one rule at a time, exact key path --------------------------------

UP = "\n[upstreams.openai]\n"
BRK = "\n[upstreams.openai.circuit_breaker]\n"
RETRY = "\n[upstreams.openai.retry]\n"
SERVER = "\n[server]\n"


def base_with(section: str, body: str) -> str:
    """BASE with `body` added inside the given table."""
    if section == UP:
        return BASE.replace(
            'base_url = "https://api.openai.com"', 'base_url = "https://api.openai.com"\n' + body
        )
    return BASE + section + body + "\n"


@pytest.mark.parametrize(
    ("section", "body", "expected"),
    [
        (BRK, "cooldown_ms = 0", "upstreams.openai.circuit_breaker.cooldown_ms: must be > 0"),
        (
            BRK,
            "failure_threshold = 0",
            "upstreams.openai.circuit_breaker.failure_threshold: must be > 0",
        ),
        (
            BRK,
            "half_open_max_probes = -1",
            "upstreams.openai.circuit_breaker.half_open_max_probes: must be > 0",
        ),
        (
            BRK,
            "success_threshold = 0",
            "upstreams.openai.circuit_breaker.success_threshold: must be > 0",
        ),
        (BRK, "bogus = 1", "upstreams.openai.circuit_breaker.bogus: unknown key"),
        (
            BRK,
            "failure_statuses = [500, 99]",
            "upstreams.openai.circuit_breaker.failure_statuses: 99: not an HTTP status (100..599)",
        ),
        (
            BRK,
            "cooldown_ms = 1.5",
            "upstreams.openai.circuit_breaker.cooldown_ms: expected an integer, got a float",
        ),
        (UP, "connect_timeout_ms = 0", "upstreams.openai.connect_timeout_ms: must be > 0"),
        (UP, "first_byte_timeout_ms = 0", "upstreams.openai.first_byte_timeout_ms: must be > 0"),
        (UP, "idle_timeout_ms = 0", "upstreams.openai.idle_timeout_ms: must be > 0"),
        (UP, "max_connections = 0", "upstreams.openai.max_connections: must be > 0"),
        (
            UP,
            "max_response_header_bytes = 0",
            "upstreams.openai.max_response_header_bytes: must be > 0",
        ),
        (
            UP,
            'auth_header = "bad header"',
            "upstreams.openai.auth_header: must be a valid HTTP header name",
        ),
        (UP, 'auth_header = ""', "upstreams.openai.auth_header: must be a valid HTTP header name"),
        (
            UP,
            'headers = { "x y" = "1" }',
            'upstreams.openai.headers."x y": must be a valid HTTP header name',
        ),
        (
            UP,
            'headers = { "x-a" = "1\\r\\nx: 2" }',
            "upstreams.openai.headers.x-a: header value must not contain CR, LF or NUL",
        ),
        (
            UP,
            'headers = { Host = "evil" }',
            "upstreams.openai.headers.Host: cannot be set here: the proxy manages this header",
        ),
        (
            UP,
            "headers = { x-a = 1 }",
            "upstreams.openai.headers.x-a: expected a string, got an integer",
        ),
        (UP, "api_key_env = 5", "upstreams.openai.api_key_env: expected a string, got an integer"),
        (UP, "retry = 5", "upstreams.openai.retry: expected a table, got an integer"),
        (
            UP,
            "circuit_breaker = []",
            "upstreams.openai.circuit_breaker: expected a table, got an array",
        ),
        (RETRY, "max_retries = -1", "upstreams.openai.retry.max_retries: must be >= 0"),
        (
            RETRY,
            'max_retries = "2"',
            "upstreams.openai.retry.max_retries: expected an integer, got a string",
        ),
        (RETRY, "backoff_initial_ms = 0", "upstreams.openai.retry.backoff_initial_ms: must be > 0"),
        (RETRY, "backoff_max_ms = 0", "upstreams.openai.retry.backoff_max_ms: must be > 0"),
        (
            RETRY,
            "retry_after_max_ms = -5",
            "upstreams.openai.retry.retry_after_max_ms: must be >= 0",
        ),
        (
            RETRY,
            "statuses = [429, 600, 42]",
            "upstreams.openai.retry.statuses: 42, 600: not an HTTP status (100..599)",
        ),
        (
            RETRY,
            'statuses = [429, "503"]',
            "upstreams.openai.retry.statuses[1]: expected an integer, got a string",
        ),
        (
            RETRY,
            "retry_on_timeout = 1",
            "upstreams.openai.retry.retry_on_timeout: expected a boolean, got an integer",
        ),
        (SERVER, "request_timeout_ms = 0", "server.request_timeout_ms: must be > 0"),
        (SERVER, "drain_timeout_ms = 0", "server.drain_timeout_ms: must be > 0"),
        (SERVER, "client_read_timeout_ms = 0", "server.client_read_timeout_ms: must be > 0"),
        (SERVER, "max_concurrent_requests = 0", "server.max_concurrent_requests: must be > 0"),
        (SERVER, "max_request_body_bytes = 0", "server.max_request_body_bytes: must be > 0"),
        (
            SERVER,
            'log_level = "verbose"',
            'server.log_level: must be one of "debug", "info", "warning", "error"',
        ),
        (
            SERVER,
            'listen = "localhost"',
            'server.listen: must be "host:port" (IPv6 as "[::1]:8080")',
        ),
        (
            SERVER,
            'listen = "::1:8080"',
            'server.listen: must be "host:port" (IPv6 as "[::1]:8080")',
        ),
        (SERVER, 'listen = "127.0.0.1:65536"', "server.listen: port must be 0..65535"),
        (
            SERVER,
            'admin_listen = "[zz]:80"',
            "server.admin_listen: is not a valid IPv6 address in brackets",
        ),
        (SERVER, "listen = 8080", "server.listen: expected a string, got an integer"),
        (SERVER, "bogus = true", "server.bogus: unknown key"),
        ("\n[metrics]\n", "x = 1", "metrics: unknown key"),
    ],
)
def test_validation_rule(section: str, body: str, expected: str) -> None:
    assert errors_of(base_with(section, body)) == [expected]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("ftp://api.openai.com", "must start with http:// or https://"),
        ("api.openai.com", "must start with http:// or https://"),
        ("https://", "must include a host"),
        ("https://api.openai.com/v1?x=1", "must not contain a query (?...)"),
        ("https://api.openai.com/?", "must not contain a query (?...)"),
        ("https://api.openai.com/v1#frag", "must not contain a fragment (#...)"),
        ("https://api.openai.com:99999", "is not a valid URL"),
        ("https://api.openai.com/ v1", "must not contain whitespace or control characters"),
        (
            "https://u:pw@api.openai.com",
            "must not contain credentials (user:password@); use api_key_env",
        ),
    ],
)
def test_base_url_rules(url: str, expected: str) -> None:
    text = BASE.replace("https://api.openai.com", url)
    assert errors_of(text) == [f"upstreams.openai.base_url: {expected}"]


@pytest.mark.parametrize(
    "url",
    [
        "https://alice:hunter2-s3cret@api.openai.com",
        "https://alice:hunter2#s3cret@api.openai.com",
        "https://alice:hunter2?s3cret@api.openai.com/v1",
        "https://hunter2-s3cret@api.openai.com",
    ],
)
def test_credentialed_base_url_is_not_echoed(url: str) -> None:
    errs = errors_of(BASE.replace("https://api.openai.com", url))
    text = "\n".join(errs)
    assert "upstreams.openai.base_url: must not contain credentials" in text
    assert "hunter2" not in text and "s3cret" not in text and "alice" not in text
    env = {"SIDECAR__UPSTREAMS__OPENAI__BASE_URL": url}
    env_text = "\n".join(errors_of(BASE, env))
    assert "hunter2" not in env_text and "s3cret" not in env_text
    assert "SIDECAR__UPSTREAMS__OPENAI__BASE_URL" in env_text


def test_api_key_env_holding_a_key_is_rejected_without_echo() -> None:
    errs = errors_of(base_with(UP, 'api_key_env = "sk-proj-abc123"'))
    assert errs == [
        "upstreams.openai.api_key_env: must be the NAME of an environment variable, not a key"
    ]


def test_candidate_names_undefined_upstream() -> None:
    text = BASE.replace('{ upstream = "backup" }', '{ upstream = "bakup" }')
    assert errors_of(text) == ['routes[0].candidates[1].upstream: no upstream named "bakup"']


def test_duplicate_route_name_reported_at_later_route() -> None:
    text = BASE + (
        '\n[[routes]]\nname = "other"\ncandidates = [{ upstream = "openai" }]\n'
        '\n[[routes]]\nname = "chat"\ncandidates = [{ upstream = "openai" }]\n'
    )
    assert errors_of(text) == ['routes[2].name: duplicate route name "chat"']


@pytest.mark.parametrize("name", ["OpenAI", "open-ai", "1st", "_x", "é"])
def test_upstream_name_pattern(name: str) -> None:
    text = BASE.replace("[upstreams.openai]", f'[upstreams."{name}"]').replace(
        '{ upstream = "openai" }', f'{{ upstream = "{name}" }}'
    )
    errs = errors_of(text)
    assert len(errs) == 1
    assert errs[0].startswith("upstreams.") and errs[0].endswith(
        ": name must match [a-z][a-z0-9_]*"
    )


def test_route_rules() -> None:
    text = BASE.replace('name = "chat"', 'name = "Chat"').replace(
        'path_prefix = "/v1/"', 'path_prefix = "v1/"\nmodels = []'
    )
    assert errors_of(text) == [
        'routes[0].path_prefix: must start with "/"',
        "routes[0].models: must list non-empty model names (omit it to match any model)",
        "routes[0].name: must match [a-z][a-z0-9_]*",
    ]


def test_route_candidates_rules() -> None:
    text = BASE.replace(
        '[{ upstream = "openai" }, { upstream = "backup" }]',
        '[{ upstream = "openai", model = "" }, { upstream = "backup", priority = 2 }, {}]',
    )
    assert errors_of(text) == [
        "routes[0].candidates[0].model: must not be empty (omit it to keep the body's model)",
        "routes[0].candidates[1].priority: unknown key",
        "routes[0].candidates[2].upstream: required key is missing",
    ]
    empty = BASE.replace('[{ upstream = "openai" }, { upstream = "backup" }]', "[]")
    assert errors_of(empty) == ["routes[0].candidates: at least one candidate is required"]
    missing = BASE.replace('candidates = [{ upstream = "openai" }, { upstream = "backup" }]', "")
    assert errors_of(missing) == ["routes[0].candidates: required key is missing"]


def test_at_least_one_route_and_upstream() -> None:
    assert errors_of("upstreams = {}\nroutes = []\n") == [
        "upstreams: at least one upstream is required",
        "routes: at least one route is required",
    ]
    assert errors_of("") == [
        "upstreams: required key is missing",
        "routes: required key is missing",
    ]


def test_many_errors_reported_together() -> None:
    text = """
[server]
listen = "nowhere"
log_level = "loud"

[upstreams.openai]
base_url = "ftp://api.openai.com"
connect_timeout_ms = 0

[upstreams.openai.circuit_breaker]
cooldown_ms = 0
bogus = 1

[upstreams.Bad]
base_url = "https://x.example"

[[routes]]
name = "chat"
path_prefix = "v1"
candidates = [{ upstream = "openai" }, { upstream = "bakup" }]

[[routes]]
name = "chat"
candidates = [{ upstream = "openai", model = 4 }]
"""
    errs = errors_of(text)
    assert sorted(errs) == sorted(
        [
            'server.listen: must be "host:port" (IPv6 as "[::1]:8080")',
            'server.log_level: must be one of "debug", "info", "warning", "error"',
            "upstreams.openai.base_url: must start with http:// or https://",
            "upstreams.openai.connect_timeout_ms: must be > 0",
            "upstreams.openai.circuit_breaker.cooldown_ms: must be > 0",
            "upstreams.openai.circuit_breaker.bogus: unknown key",
            "upstreams.Bad: name must match [a-z][a-z0-9_]*",
            'routes[0].path_prefix: must start with "/"',
            'routes[0].candidates[1].upstream: no upstream named "bakup"',
            'routes[1].name: duplicate route name "chat"',
            "routes[1].candidates[0].model: expected a string, got an integer",
        ]
    )


def test_toml_syntax_error_names_source() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config("[server\nlisten=", {}, source="my.toml")
    assert len(exc.value.errors) == 1
    assert exc.value.errors[0].startswith("my.toml: invalid TOML: ")


# ---- files and lookup ----------------------------------------------------------------


def test_load_config_from_file(tmp_path: Path) -> None:
    p = tmp_path / "s.toml"
    p.write_text(BASE, encoding="utf-8")
    assert load_config(str(p), {}) == parse_config(BASE, {})
    with pytest.raises(ConfigError) as exc:
        load_config(str(tmp_path / "nope.toml"), {})
    assert exc.value.errors[0].startswith(f"{tmp_path / 'nope.toml'}: cannot read config file")


def test_resolve_config_path_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFAULT_CONFIG_PATH == "/etc/sidecar/sidecar.toml"
    default = tmp_path / "sidecar.toml"
    env = {"SIDECAR_CONFIG": "/from/env.toml"}
    # the CLI path wins over everything, and is returned even if it does not exist
    assert resolve_config_path("/cli.toml", env, default_path=str(default)) == "/cli.toml"
    assert resolve_config_path(None, env, default_path=str(default)) == "/from/env.toml"
    # an empty SIDECAR_CONFIG counts as unset; a missing default file means embedded (None)
    assert resolve_config_path(None, {"SIDECAR_CONFIG": ""}, default_path=str(default)) is None
    assert resolve_config_path(None, {}, default_path=str(default)) is None
    default.write_text(BASE, encoding="utf-8")
    assert resolve_config_path(None, {}, default_path=str(default)) == str(default)
    assert resolve_config_path(None, env, default_path=str(default)) == "/from/env.toml"
    # the module attribute is read at call time
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", str(default))
    assert resolve_config_path(None, {}) == str(default)
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))
    assert resolve_config_path(None, {}) is None


# ---- environment overrides -------------------------------------------------------------


def test_env_override_string_int_list_bool() -> None:
    env = {
        "SIDECAR__SERVER__LISTEN": "0.0.0.0:8081",
        "SIDECAR__SERVER__LOG_LEVEL": "debug",
        "SIDECAR__UPSTREAMS__OPENAI__RETRY__MAX_RETRIES": "5",
        "SIDECAR__UPSTREAMS__OPENAI__RETRY__STATUSES": "[429, 503]",
        "SIDECAR__UPSTREAMS__OPENAI__RETRY__RETRY_ON_TIMEOUT": "true",
        "SIDECAR__UPSTREAMS__OPENAI__BASE_URL": "https://proxy.example.com/openai",
        "SIDECAR_CONFIG": "/not/an/override.toml",
        "OTHER": "x",
    }
    c = parse_config(BASE, env)
    assert c.server.listen == "0.0.0.0:8081"
    assert c.server.log_level == "debug"
    up = c.upstreams["openai"]
    assert up.retry.max_retries == 5
    assert up.retry.statuses == frozenset({429, 503})
    assert up.retry.retry_on_timeout is True
    assert up.base_url == "https://proxy.example.com/openai"


def test_env_override_names_are_case_insensitive() -> None:
    c = parse_config(BASE, {"sidecar__server__drain_timeout_ms": "1000"})
    assert c.server.drain_timeout_ms == 1000


def test_env_override_creates_tables() -> None:
    env = {
        "SIDECAR__UPSTREAMS__OPENAI__CIRCUIT_BREAKER__COOLDOWN_MS": "1000",
        "SIDECAR__UPSTREAMS__EXTRA__BASE_URL": "http://127.0.0.1:9999",
        "SIDECAR__UPSTREAMS__EXTRA__API_KEY_ENV": "EXTRA_KEY",
        "SIDECAR__UPSTREAMS__EXTRA__HEADERS": '{ "x-org" = "acme" }',
    }
    c = parse_config(BASE, env)
    assert c.upstreams["openai"].circuit_breaker == BreakerConfig(cooldown_ms=1000)
    extra = c.upstreams["extra"]
    assert extra.base_url == "http://127.0.0.1:9999"
    assert extra.headers == {"x-org": "acme"}
    assert missing_api_key_envs(c, {}) == [("extra", "EXTRA_KEY")]


def test_env_override_route_index() -> None:
    env = {
        "SIDECAR__ROUTES__0__PATH_PREFIX": "/v2/",
        "SIDECAR__ROUTES__0__CANDIDATES__1__MODEL": "4",
        "SIDECAR__ROUTES__0__MODELS": '["a", "b"]',
    }
    c = parse_config(BASE, env)
    assert c.routes[0].path_prefix == "/v2/"
    assert c.routes[0].candidates[1].model == "4"  # a string key keeps the raw string
    assert c.routes[0].models == frozenset({"a", "b"})


def test_env_override_whole_section_as_inline_table() -> None:
    c = parse_config(BASE, {"SIDECAR__SERVER": '{ listen = "127.0.0.1:1", log_level = "error" }'})
    assert c.server.listen == "127.0.0.1:1" and c.server.log_level == "error"


def test_env_bad_value_names_variable_and_path() -> None:
    env = {
        "SIDECAR__UPSTREAMS__OPENAI__RETRY__MAX_RETRIES": "lots",
        "SIDECAR__UPSTREAMS__OPENAI__CIRCUIT_BREAKER__COOLDOWN_MS": "0",
        "SIDECAR__SERVER__BOGUS": "1",
        "SIDECAR__ROUTES__0__CANDIDATES__0__UPSTREAM": "bakup",
    }
    assert sorted(errors_of(BASE, env)) == sorted(
        [
            "upstreams.openai.retry.max_retries: expected an integer, got a string"
            " (from SIDECAR__UPSTREAMS__OPENAI__RETRY__MAX_RETRIES)",
            "upstreams.openai.circuit_breaker.cooldown_ms: must be > 0"
            " (from SIDECAR__UPSTREAMS__OPENAI__CIRCUIT_BREAKER__COOLDOWN_MS)",
            "server.bogus: unknown key (from SIDECAR__SERVER__BOGUS)",
            'routes[0].candidates[0].upstream: no upstream named "bakup"'
            " (from SIDECAR__ROUTES__0__CANDIDATES__0__UPSTREAM)",
        ]
    )


def test_env_structural_errors() -> None:
    assert errors_of(BASE, {"SIDECAR__ROUTES__3__NAME": "x"}) == [
        "routes[3]: no such entry (the list has 1) (from SIDECAR__ROUTES__3__NAME)"
    ]
    assert errors_of(BASE, {"SIDECAR__ROUTES__FIRST__NAME": "x"}) == [
        "routes: is a list: the next name part must be an index (0, 1, ...)"
        " (from SIDECAR__ROUTES__FIRST__NAME)"
    ]
    assert errors_of(BASE, {"SIDECAR__UPSTREAMS__OPENAI__BASE_URL__X": "1"}) == [
        "upstreams.openai.base_url: is not a table: cannot set a key inside it"
        " (from SIDECAR__UPSTREAMS__OPENAI__BASE_URL__X)"
    ]
    assert errors_of(BASE, {"SIDECAR__SERVER____LISTEN": "x"}) == [
        "SIDECAR__SERVER____LISTEN: malformed override name: empty key between '__'"
    ]
    errs = errors_of(BASE, {"SIDECAR__SERVER__LISTEN": "a:1", "sidecar__server__listen": "b:2"})
    assert len(errs) == 1 and errs[0].startswith("server.listen: also set by ")


# ---- api_key_env and rendering -----------------------------------------------------------


def test_missing_api_key_envs() -> None:
    text = base_with(UP, 'api_key_env = "OPENAI_API_KEY"')
    c = parse_config(text, {})
    assert missing_api_key_envs(c, {}) == [("openai", "OPENAI_API_KEY")]
    assert missing_api_key_envs(c, {"OPENAI_API_KEY": ""}) == [("openai", "OPENAI_API_KEY")]
    assert missing_api_key_envs(c, {"OPENAI_API_KEY": "sk-x"}) == []


def test_render_effective_round_trips() -> None:
    for c in (load_config(None, {}), parse_config(FULL, {}), parse_config(BASE, {})):
        assert parse_config(render_effective(c), {}) == c


def test_render_effective_redacts_credentials_and_never_shows_key_values() -> None:
    body = (
        'api_key_env = "OPENAI_API_KEY"\n'
        'headers = { Authorization = "Bearer sk-aaa", X-API-KEY = "sk-bbb", api-key = "sk-ccc",'
        ' COOKIE = "sid=sk-ddd", "X-Goog-Api-Key" = "sk-eee", "x-org" = "acme" }'
    )
    env = {"OPENAI_API_KEY": "sk-the-real-secret"}
    c = parse_config(base_with(UP, body), env)
    out = render_effective(c)
    assert "sk-" not in out
    assert "OPENAI_API_KEY" in out
    assert out.count('"<redacted>"') == 5
    assert 'x-org = "acme"' in out
    again = parse_config(out, env)
    assert again.upstreams["openai"].headers["Authorization"] == "<redacted>"
    assert again.upstreams["openai"].headers["x-org"] == "acme"


def test_render_effective_quotes_odd_keys_and_strings() -> None:
    c = parse_config(base_with(UP, 'headers = { "x-q" = "a \\"b\\" \\\\ \\t \\u007f é" }'), {})
    assert parse_config(render_effective(c), {}) == c


def test_config_is_frozen() -> None:
    c = load_config(None, {})
    with pytest.raises(AttributeError):
        c.server = ServerConfig()  # type: ignore[misc]
    assert isinstance(c, Config)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("", "credential"),  # each client's own key passes through
        ('api_key_env = "K"', "target"),  # one key for everyone
        ('api_key_env = "K"\nrate_limit_scope = "credential"', "credential"),
        ('rate_limit_scope = "target"', "target"),
    ],
)
def test_rate_limit_scope_defaults_by_api_key_env(body: str, expected: str) -> None:
    """Contract, "Configuration": ``rate_limit_scope`` is ``credential`` without
    ``api_key_env`` and ``target`` with it; the effective config names it."""
    c = parse_config(base_with(UP, body), {})
    assert c.upstreams["openai"].rate_limit_scope == expected
    assert f'rate_limit_scope = "{expected}"' in render_effective(c)


def test_rate_limit_scope_refuses_other_values() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(base_with(UP, 'rate_limit_scope = "key"'), {})
    assert info.value.errors == [
        'upstreams.openai.rate_limit_scope: must be one of "credential", "target"'
    ]

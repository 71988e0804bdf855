"""Configuration: one TOML file plus ``SIDECAR__`` environment overrides (pure but for reading).

The TOML is parsed with :mod:`tomllib`, overrides are merged into the raw mapping
(:mod:`sidecar.config.overrides`), then the mapping is decoded strictly into frozen
msgspec Structs (:mod:`sidecar.config.decode`, with the rules of
:mod:`sidecar.config.checks`). Decoding goes field by field so that *every* error is
reported, each as ``dotted.key.path[0].x: message``; :class:`ConfigError` carries them all.
A valid config may still get warnings (:mod:`sidecar.config.lint`: an upstream no route
uses, a route no request can reach), returned by :func:`load_config_with_warnings`.
Durations are integers in milliseconds (``*_ms``), sizes in bytes (``*_bytes``).
"""

import importlib.resources
import os
import re
import tomllib
from collections.abc import Mapping
from typing import Annotated, Literal, NamedTuple

import msgspec

from sidecar.config.checks import CHECKS, cross_check
from sidecar.config.checks import split_host_port as split_host_port  # re-exported
from sidecar.config.decode import Err, decode_struct, describe
from sidecar.config.lint import config_warnings
from sidecar.config.overrides import apply_env_overrides, near_misses
from sidecar.config.toml_writer import toml_dumps

PosInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Share = Annotated[float, msgspec.Meta(ge=0, le=1)]
Percent = Annotated[float, msgspec.Meta(ge=0, le=100)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
Balance = Literal["least_loaded", "weighted", "ordered"]
DEFAULT_CONFIG_PATH = "/etc/sidecar/sidecar.toml"
REDACTED = "<redacted>"


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[server]``: ``host:port`` listen addresses (IPv6 ``[::1]:8080``); limits in ms, bytes."""

    listen: str = "127.0.0.1:8080"
    admin_listen: str = "0.0.0.0:9090"
    client_retry_hint: bool = True  # x-should-retry: false where another try is futile
    max_request_body_bytes: PosInt = 33554432
    request_timeout_ms: PosInt = 600000
    drain_timeout_ms: PosInt = 25000
    max_concurrent_requests: PosInt = 1024
    client_read_timeout_ms: PosInt = 30000
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = True
    """One JSON ``request`` line per proxied request, whatever ``log_level`` is."""
    admin_token_env: Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z_][A-Za-z0-9_]*)?$")] = ""
    """The *name* of the variable holding the token of the admin port's write actions
    (``POST /breakers/...``); "" (or an unset or empty variable) = those do not exist."""

    @property
    def request_timeout_s(self) -> float:
        return self.request_timeout_ms / 1000

    @property
    def drain_timeout_s(self) -> float:
        return self.drain_timeout_ms / 1000

    @property
    def client_read_timeout_s(self) -> float:
        return self.client_read_timeout_ms / 1000


class RetryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[upstreams.<name>.retry]``: attempts per candidate = 1 + ``max_retries``; times in ms."""

    max_retries: NonNegInt = 2
    backoff_initial_ms: PosInt = 250
    backoff_max_ms: PosInt = 2000
    retry_after_max_ms: NonNegInt = 60000
    statuses: frozenset[int] = frozenset({408, 429, 500, 502, 503, 504, 529})
    retry_on_timeout: bool = False
    jitter: bool = True
    """Each backoff wait is drawn uniformly from [0, the exponential backoff] ("full
    jitter"); a ``Retry-After`` is waited as it came. False: the backoff itself."""
    budget_percent: Percent = 20.0
    """Retries in flight to the upstream may reach this % of its requests in flight ..."""
    min_retry_concurrency: NonNegInt = 3
    """... or this many, whichever is larger; past it, no retry (fall back instead)."""


class BreakerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[upstreams.<name>.circuit_breaker]``: counts and ``cooldown_ms`` (milliseconds)."""

    failure_threshold: PosInt = 3
    cooldown_ms: PosInt = 30000
    half_open_max_probes: PosInt = 1
    success_threshold: PosInt = 1
    failure_statuses: frozenset[int] = frozenset({408, 429, 500, 501, 502, 503, 504, 529})
    slow_call_ms: NonNegInt = 0  # a success whose first output took longer is a failure; 0 off
    failure_rate_threshold: Share = 0.0  # > 0: also open on this share of failed calls
    window_ms: PosInt = 60000  # the failure-rate window
    minimum_calls: PosInt = 20  # calls the window must hold before its rate can open it
    ramp_ms: NonNegInt = 0  # > 0: after a probe closes it, the target's share ramps up

    @property
    def cooldown_s(self) -> float:
        return self.cooldown_ms / 1000

    @property
    def slow_call_s(self) -> float:
        """``slow_call_ms`` in seconds (0.0 = off)."""
        return self.slow_call_ms / 1000


class UpstreamConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[upstreams.<name>]``: one provider. ``base_url`` never ends with ``/``.

    ``api_key_env`` is the *name* of the variable holding the key (never the key);
    ``auth_header`` is lower-cased. ``circuit_breaker`` None = no breaker. Times in ms.
    """

    base_url: str
    api_key_env: str | None = None
    auth_header: str = "authorization"
    headers: dict[str, str] = {}
    connect_timeout_ms: PosInt = 5000
    first_byte_timeout_ms: PosInt = 60000
    idle_timeout_ms: PosInt = 120000
    max_connections: PosInt = 256
    max_response_header_bytes: PosInt = 65536
    """Longest response header line or field accepted (aiohttp's own default is 8190)."""
    empty_turn_is_failure: bool = True
    """A clean turn with no output is retried once, then a failure (contract, "An empty
    turn is a failure"); False: relayed as a success, as any other answer."""
    rate_limit_scope: Literal["credential", "target"] | None = None
    """Where a rate-limit failure counts (contract, "Bounding the load that failures add"):
    ``credential``, the breaker of (target, the request's ``auth_header`` value);
    ``target``, the target's own breaker. None: ``target`` with ``api_key_env`` (one key
    for everyone), else ``credential``: resolved when the config is read, so the
    effective config (``check-config``) names it."""
    ca_file: str = ""
    """A PEM bundle of CA certificates trusted besides the system's (a private CA in front
    of a self-hosted vLLM); "" = the system's only (:func:`sidecar.egress.client_ssl`)."""
    retry: RetryConfig = RetryConfig()
    circuit_breaker: BreakerConfig | None = None

    def __post_init__(self) -> None:
        if self.rate_limit_scope is None:
            scope = "credential" if self.api_key_env is None else "target"
            msgspec.structs.force_setattr(self, "rate_limit_scope", scope)

    @property
    def rate_limits_per_credential(self) -> bool:
        """Whether the effective ``rate_limit_scope`` is ``credential``."""
        return self.rate_limit_scope != "target"

    @property
    def connect_timeout_s(self) -> float:
        return self.connect_timeout_ms / 1000

    @property
    def first_byte_timeout_s(self) -> float:
        return self.first_byte_timeout_ms / 1000

    @property
    def idle_timeout_s(self) -> float:
        return self.idle_timeout_ms / 1000


class CandidateConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One entry of a route's ``candidates``; ``model`` rewrites the body's ``model``.

    ``tier`` (>= 0; None: the route is an ordered list): candidates of one tier are
    equal members, chosen among by the route's ``balance`` in proportion to ``weight``
    (> 0); tiers are tried in ascending order (contract, "Choosing among candidates").
    """

    upstream: str
    model: str | None = None
    tier: NonNegInt | None = None
    weight: PosFloat | None = None  # None: 1 (only routes with tiers read it)


class RouteConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[routes]]`` entry; ``models`` None matches any body; candidates in order (>= 1).

    ``match_headers``: lower-cased header name -> ``"*"`` (present) or the exact value;
    empty = no header condition.
    """

    name: str
    context_window_fallback: bool = True  # a context-window 400/413 moves to the next candidate
    path_prefix: str = "/"
    models: frozenset[str] | None = None
    match_headers: dict[str, str] = {}
    balance: Balance = "least_loaded"  # inside a tier: least_loaded | weighted | ordered
    affinity_header: str | None = None  # requests with the same value keep to one member
    affinity_ttl_ms: PosInt = 3600000  # a session unseen this long is forgotten
    hedge_after_ms: NonNegInt = 0  # > 0: no output this long -> race the next candidate
    candidates: tuple[CandidateConfig, ...]


class FleetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[fleet]``: breakers shared through Redis (contract, "The fleet"); absent = off.

    ``redis_url_env`` names the variable holding ``redis://[user:password@]host:port/db``
    (``rediss://`` for TLS); the URL is a secret and never part of the config.
    ``sync_interval_ms``: milliseconds between reads of the fleet's state.
    ``open_quorum``: distinct members whose own breaker opened a target before the
    fleet opens it.
    """

    redis_url_env: str = "SIDECAR_REDIS_URL"
    key_prefix: str = "sidecar:"
    sync_interval_ms: PosInt = 1000
    open_quorum: PosInt = 1

    @property
    def sync_interval_s(self) -> float:
        return self.sync_interval_ms / 1000


class TracingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[tracing]``: OpenTelemetry traces over OTLP/HTTP (contract, "Traces"); absent = off,
    and nothing of OpenTelemetry is imported (:mod:`sidecar.tracing`).

    ``otlp_endpoint``: the full OTLP/HTTP traces URL (protobuf), ``http(s)`` with no
    credentials in it (an exporter's auth goes in ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``);
    ``sample_ratio`` (0..1): the share of requests without a sampled parent that are
    traced (``ParentBased(TraceIdRatioBased)``); ``propagate``: upstream requests carry a
    ``traceparent`` naming their attempt's span; ``service_name``: the resource's
    ``service.name``.
    """

    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    sample_ratio: Share = 1.0
    propagate: bool = False
    service_name: str = "sidecar"


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration (at least one upstream and one route; all names resolved)."""

    server: ServerConfig = ServerConfig()
    upstreams: dict[str, UpstreamConfig]
    routes: tuple[RouteConfig, ...]
    fleet: FleetConfig | None = None
    tracing: TracingConfig | None = None


class ConfigError(Exception):
    """An invalid configuration. ``errors``: every problem, as ``key.path[0].x: message``."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


def resolve_config_path(
    cli_path: str | None, environ: Mapping[str, str], *, default_path: str | None = None
) -> str | None:
    """The config file to load: ``--config``, else ``SIDECAR_CONFIG`` (when non-empty),
    else ``default_path`` (default: module attribute :data:`DEFAULT_CONFIG_PATH`) when it
    exists, else None, meaning the embedded default. Does not check that a given path exists.
    """
    if cli_path is not None:
        return cli_path
    if environ.get("SIDECAR_CONFIG"):
        return environ["SIDECAR_CONFIG"]
    default = DEFAULT_CONFIG_PATH if default_path is None else default_path
    return default if os.path.exists(default) else None


class LoadedConfig(NamedTuple):
    """A valid config and its warnings (:func:`sidecar.config.lint.config_warnings`)."""

    config: Config
    warnings: list[Err]
    """(key path, message) for each thing that loads but is almost surely a mistake."""


def load_config(path: str | None, environ: Mapping[str, str]) -> Config:
    """Load and validate the config file at ``path`` (None: the embedded ``default.toml``),
    with ``SIDECAR__`` overrides from ``environ``.

    :raises ConfigError: with every error found, an unreadable file included.
    """
    return load_config_with_warnings(path, environ).config


def load_config_with_warnings(path: str | None, environ: Mapping[str, str]) -> LoadedConfig:
    """Like :func:`load_config`, with the config's warnings.

    :raises ConfigError: with every error found, an unreadable file included.
    """
    if path is None:
        resource = importlib.resources.files("sidecar").joinpath("default.toml")
        return parse_config_with_warnings(
            resource.read_text("utf-8"), environ, "<embedded default>"
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read config file: {e.strerror or e}"]) from None
    except UnicodeDecodeError:
        raise ConfigError([f"{path}: config file is not UTF-8"]) from None
    return parse_config_with_warnings(text, environ, path)


def parse_config(text: str, environ: Mapping[str, str], source: str = "<config>") -> Config:
    """Like :func:`load_config`, from TOML text; ``source`` names it in syntax errors.

    :raises ConfigError: with every error found.
    """
    return parse_config_with_warnings(text, environ, source).config


def parse_config_with_warnings(
    text: str, environ: Mapping[str, str], source: str = "<config>"
) -> LoadedConfig:
    """Like :func:`parse_config`, with the config's warnings.

    :raises ConfigError: with every error found.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{source}: invalid TOML: {e}"]) from None
    origins, errors, created = apply_env_overrides(raw, environ, Config)
    config = decode_struct(raw, Config, "", errors, CHECKS)
    cross_check(raw, errors)
    if errors or config is None:
        notes = {path: f"{path} is {table.note()}" for path, table in created.items()}
        raise ConfigError(describe(errors, origins, notes))
    warnings = config_warnings(config, created)
    warnings += near_misses(environ, Config.__struct_fields__)
    return LoadedConfig(config, warnings)


def missing_api_key_envs(config: Config, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """``[(upstream name, variable name)]`` for each ``api_key_env`` that is unset or empty."""
    return [
        (name, up.api_key_env)
        for name, up in config.upstreams.items()
        if up.api_key_env is not None and not environ.get(up.api_key_env)
    ]


_SECRET_HEADER = re.compile(r"auth|key|cookie|token|secret|passw|session", re.I)


def render_effective(config: Config) -> str:
    """The effective config as TOML text, loadable again by :func:`parse_config`.

    Values of credential-like ``headers`` become ``"<redacted>"``: authorization, x-api-key,
    api-key, cookie, in any case, and any name containing auth, key, cookie, token, secret,
    passw or session.
    ``api_key_env`` is a variable name; its value is never looked up.
    """
    data = msgspec.to_builtins(config, order="deterministic")
    for up in data["upstreams"].values():
        up["headers"] = {
            k: REDACTED if _SECRET_HEADER.search(k) else v for k, v in up["headers"].items()
        }
    return "# effective sidecar configuration (credential headers redacted)\n\n" + toml_dumps(data)

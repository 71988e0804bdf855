"""Configuration: one TOML file plus ``SIDECAR__`` environment overrides (pure but for reading).

The TOML is parsed with :mod:`tomllib`, overrides are merged into the raw mapping
(:mod:`sidecar.config_env`), then the mapping is decoded strictly into frozen
msgspec Structs. Decoding goes field by field so that *every* error is reported,
each as ``dotted.key.path[0].x: message``; :class:`ConfigError` carries them all.
Durations are integers in milliseconds (``*_ms``), sizes in bytes (``*_bytes``).
"""

import importlib.resources
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

from sidecar.config_env import (
    Check,
    Err,
    apply_env_overrides,
    decode_struct,
    describe,
    join_path,
    toml_dumps,
)

PosInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
DEFAULT_CONFIG_PATH = "/etc/sidecar/sidecar.toml"
REDACTED = "<redacted>"


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[server]``: ``host:port`` listen addresses (IPv6 ``[::1]:8080``); limits in ms, bytes."""

    listen: str = "127.0.0.1:8080"
    admin_listen: str = "0.0.0.0:9090"
    max_request_body_bytes: PosInt = 33554432
    request_timeout_ms: PosInt = 600000
    drain_timeout_ms: PosInt = 25000
    max_concurrent_requests: PosInt = 1024
    client_read_timeout_ms: PosInt = 30000
    log_level: Literal["debug", "info", "warning", "error"] = "info"

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


class BreakerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[upstreams.<name>.circuit_breaker]``: counts and ``cooldown_ms`` (milliseconds)."""

    failure_threshold: PosInt = 3
    cooldown_ms: PosInt = 30000
    half_open_max_probes: PosInt = 1
    success_threshold: PosInt = 1
    failure_statuses: frozenset[int] = frozenset({408, 429, 500, 501, 502, 503, 504, 529})

    @property
    def cooldown_s(self) -> float:
        return self.cooldown_ms / 1000


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
    retry: RetryConfig = RetryConfig()
    circuit_breaker: BreakerConfig | None = None

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
    """One entry of a route's ``candidates``; ``model`` rewrites the body's ``model``."""

    upstream: str
    model: str | None = None


class RouteConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[routes]]`` entry; ``models`` None matches any body; candidates in order (>= 1)."""

    name: str
    path_prefix: str = "/"
    models: frozenset[str] | None = None
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


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration (at least one upstream and one route; all names resolved)."""

    server: ServerConfig = ServerConfig()
    upstreams: dict[str, UpstreamConfig]
    routes: tuple[RouteConfig, ...]
    fleet: FleetConfig | None = None


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


def load_config(path: str | None, environ: Mapping[str, str]) -> Config:
    """Load and validate the config file at ``path`` (None: the embedded ``default.toml``),
    with ``SIDECAR__`` overrides from ``environ``.

    :raises ConfigError: with every error found, an unreadable file included.
    """
    if path is None:
        resource = importlib.resources.files("sidecar").joinpath("default.toml")
        return parse_config(resource.read_text("utf-8"), environ, "<embedded default>")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read config file: {e.strerror or e}"]) from None
    except UnicodeDecodeError:
        raise ConfigError([f"{path}: config file is not UTF-8"]) from None
    return parse_config(text, environ, path)


def parse_config(text: str, environ: Mapping[str, str], source: str = "<config>") -> Config:
    """Like :func:`load_config`, from TOML text; ``source`` names it in syntax errors.

    :raises ConfigError: with every error found.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{source}: invalid TOML: {e}"]) from None
    origins, errors = apply_env_overrides(raw, environ, Config)
    config = decode_struct(raw, Config, "", errors, _CHECKS)
    _cross_check(raw, errors)
    if errors or config is None:
        raise ConfigError(describe(errors, origins))
    return config


def missing_api_key_envs(config: Config, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """``[(upstream name, variable name)]`` for each ``api_key_env`` that is unset or empty."""
    return [
        (name, up.api_key_env)
        for name, up in config.upstreams.items()
        if up.api_key_env is not None and not environ.get(up.api_key_env)
    ]


def split_host_port(addr: str) -> tuple[str, int]:
    """``"host:port"`` / ``"[::1]:8080"`` -> (host without brackets, port).

    :raises ValueError: with a message fit for a config error.
    """
    m = re.fullmatch(r"\[([0-9A-Fa-f:.%\w]+)\]:(\d{1,5})|([A-Za-z0-9.-]+):(\d{1,5})", addr)
    if not m:
        raise ValueError('must be "host:port" (IPv6 as "[::1]:8080")')
    host, port = (m[1], int(m[2])) if m[1] else (m[3], int(m[4]))
    if m[1]:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError("is not a valid IPv6 address in brackets") from None
    if port > 65535:
        raise ValueError("port must be 0..65535")
    return host, port


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


# ---- validation ------------------------------------------------------------------

_NAME = re.compile(r"[a-z][a-z0-9_]*")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MANAGED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


def _check_listen(v: str, path: str, errors: list[Err]) -> str:
    try:
        split_host_port(v)
    except ValueError as e:
        errors.append((path, str(e)))
    return v


def _check_base_url(v: str, path: str, errors: list[Err]) -> str:
    """http(s), a host, no credentials/query/fragment. Messages never echo the URL."""
    if "@" in v:
        errors.append((path, "must not contain credentials (user:password@); use api_key_env"))
        return v
    if any(c.isspace() or not c.isprintable() for c in v):
        errors.append((path, "must not contain whitespace or control characters"))
        return v
    try:
        u = urlsplit(v)
        _ = u.port
    except ValueError:
        errors.append((path, "is not a valid URL"))
        return v
    if u.scheme.lower() not in ("http", "https"):
        errors.append((path, "must start with http:// or https://"))
    elif not u.hostname:
        errors.append((path, "must include a host"))
    if "?" in v:
        errors.append((path, "must not contain a query (?...)"))
    if "#" in v:
        errors.append((path, "must not contain a fragment (#...)"))
    return v.rstrip("/")


def _check_auth_header(v: str, path: str, errors: list[Err]) -> str:
    if not _TOKEN.fullmatch(v):
        errors.append((path, "must be a valid HTTP header name"))
    return v.lower()


def _check_headers(v: dict[str, str], path: str, errors: list[Err]) -> dict[str, str]:
    for name, value in v.items():
        p = join_path(path, name)
        if not _TOKEN.fullmatch(name):
            errors.append((p, "must be a valid HTTP header name"))
        elif name.lower() in _MANAGED_HEADERS:
            errors.append((p, "cannot be set here: the proxy manages this header"))
        if any(c in value for c in "\r\n\0"):
            errors.append((p, "header value must not contain CR, LF or NUL"))
    return v


def _check_statuses(v: frozenset[int], path: str, errors: list[Err]) -> frozenset[int]:
    if bad := sorted(s for s in v if not 100 <= s <= 599):
        errors.append((path, f"{', '.join(map(str, bad))}: not an HTTP status (100..599)"))
    return v


def _rule(ok: Callable[[Any], object], message: str) -> Check:
    """A check that appends ``message`` (never the value) when ``ok(value)`` is false."""

    def check(v: Any, path: str, errors: list[Err]) -> Any:
        if not ok(v):
            errors.append((path, message))
        return v

    return check


_CHECKS: dict[tuple[type, str], Check] = {
    (ServerConfig, "listen"): _check_listen,
    (ServerConfig, "admin_listen"): _check_listen,
    (UpstreamConfig, "base_url"): _check_base_url,
    (UpstreamConfig, "auth_header"): _check_auth_header,
    (UpstreamConfig, "headers"): _check_headers,
    (UpstreamConfig, "api_key_env"): _rule(  # never echoed: it may be a key pasted by mistake
        _ENV_NAME.fullmatch, "must be the NAME of an environment variable, not a key"
    ),
    (RetryConfig, "statuses"): _check_statuses,
    (BreakerConfig, "failure_statuses"): _check_statuses,
    (RouteConfig, "path_prefix"): _rule(lambda v: v.startswith("/"), 'must start with "/"'),
    (RouteConfig, "models"): _rule(
        lambda v: v and "" not in v,
        "must list non-empty model names (omit it to match any model)",
    ),
    (RouteConfig, "candidates"): _rule(bool, "at least one candidate is required"),
    (CandidateConfig, "model"): _rule(bool, "must not be empty (omit it to keep the body's model)"),
    (FleetConfig, "redis_url_env"): _rule(  # never echoed: it may be a URL pasted by mistake
        _ENV_NAME.fullmatch, "must be the NAME of an environment variable, not a URL"
    ),
    (FleetConfig, "key_prefix"): _rule(
        lambda v: 0 < len(v) <= 64 and v.isprintable() and not any(c.isspace() for c in v),
        "must be 1..64 printable characters without spaces",
    ),
}


def _cross_check(raw: dict[str, Any], errors: list[Err]) -> None:
    """Rules across tables, on the raw mapping so they run even where decoding failed."""
    ups, routes = raw.get("upstreams"), raw.get("routes")
    if isinstance(ups, dict):
        if not ups:
            errors.append(("upstreams", "at least one upstream is required"))
        for name in ups:
            if not _NAME.fullmatch(name):
                errors.append((join_path("upstreams", name), "name must match [a-z][a-z0-9_]*"))
    if not isinstance(routes, list):
        return
    if not routes:
        errors.append(("routes", "at least one route is required"))
    seen: set[str] = set()
    for i, route in enumerate(routes):
        if not isinstance(route, dict):
            continue
        name, cands = route.get("name"), route.get("candidates")
        if isinstance(name, str):
            if not _NAME.fullmatch(name):
                errors.append((f"routes[{i}].name", "must match [a-z][a-z0-9_]*"))
            elif name in seen:
                errors.append((f"routes[{i}].name", f"duplicate route name {json.dumps(name)}"))
            seen.add(name)
        for j, cand in enumerate(cands if isinstance(cands, list) else []):
            up = cand.get("upstream") if isinstance(cand, dict) else None
            if isinstance(up, str) and isinstance(ups, dict) and up not in ups:
                p = f"routes[{i}].candidates[{j}].upstream"
                errors.append((p, f"no upstream named {json.dumps(up)}"))

"""The config's validation rules (pure): per-field checks and the rules across tables.

Each check takes a decoded value, its dotted key path and the error list, appends
``(path, message)`` for each problem (messages never echo a value that may be a
secret) and returns the value to keep (maybe normalised). :data:`CHECKS` maps
(Struct class name, field) to its check; :func:`cross_check` runs on the raw mapping.
"""

from __future__ import annotations

import ipaddress
import json
import re
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from sidecar.config.decode import Check, Err, join_path


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


def _check_otlp_endpoint(v: str, path: str, errors: list[Err]) -> str:
    """An ``http(s)`` URL with a host and no credentials, query or fragment (its path is
    the signal's own: ``/v1/traces``); a collector's token goes in OpenTelemetry's
    header variables. Messages never echo the URL."""
    if "@" in v:
        errors.append(
            (path, "must not contain credentials (user:password@); use OTEL_EXPORTER_OTLP_HEADERS")
        )
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
    if "?" in v or "#" in v:  # a token there would show in check-config's output
        errors.append(
            (path, "must not contain a query or fragment; use OTEL_EXPORTER_OTLP_HEADERS")
        )
    return v


def _check_ca_file(v: str, path: str, errors: list[Err]) -> str:
    """``ca_file``: "" (none), or a readable file holding at least one PEM certificate
    (loaded as the sidecar will load it: :func:`sidecar.egress.client_ssl`). The only
    check that reads a file: a bundle that would fail at start fails here."""
    if not v:
        return v
    try:
        ctx = ssl.create_default_context()
        ctx.load_verify_locations(cafile=v)
    except FileNotFoundError:
        errors.append((path, "file not found"))
    except IsADirectoryError:
        errors.append((path, "is a directory, not a PEM file"))
    except PermissionError:
        errors.append((path, "file cannot be read (permission denied)"))
    except (ssl.SSLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or type(e).__name__
        errors.append((path, f"holds no PEM certificate the sidecar can load ({reason})"))
    return v


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


def _check_match_headers(v: dict[str, str], path: str, errors: list[Err]) -> dict[str, str]:
    """Header names (any case, stored lower-cased), each once; values that can ever match."""
    out: dict[str, str] = {}
    for name, value in v.items():
        p = join_path(path, name)
        if not _TOKEN.fullmatch(name):
            errors.append((p, "must be a valid HTTP header name"))
        elif name.lower() in out:
            errors.append((p, "duplicate header name (names are case-insensitive)"))
        if any(c in value for c in "\r\n\0"):
            errors.append((p, "header value must not contain CR, LF or NUL"))
        elif value != value.strip(" \t"):
            errors.append((p, "must not start or end with whitespace (it could never match)"))
        out[name.lower()] = value
    return out


def _check_statuses(v: frozenset[int], path: str, errors: list[Err]) -> frozenset[int]:
    if bad := sorted(s for s in v if not 100 <= s <= 599):
        errors.append((path, f"{', '.join(map(str, bad))}: not an HTTP status (100..599)"))
    return v


def _check_affinity_header(v: str, path: str, errors: list[Err]) -> str:
    """An HTTP header name (RFC 9110 5.1), kept lower-cased."""
    if not _TOKEN.fullmatch(v):
        errors.append((path, "must be an HTTP header name"))
    return v.lower()


def _rule(ok: Callable[[Any], object], message: str) -> Check:
    """A check that appends ``message`` (never the value) when ``ok(value)`` is false."""

    def check(v: Any, path: str, errors: list[Err]) -> Any:
        if not ok(v):
            errors.append((path, message))
        return v

    return check


CHECKS: dict[tuple[str, str], Check] = {
    ("ServerConfig", "listen"): _check_listen,
    ("ServerConfig", "admin_listen"): _check_listen,
    ("UpstreamConfig", "base_url"): _check_base_url,
    ("UpstreamConfig", "auth_header"): _check_auth_header,
    ("UpstreamConfig", "headers"): _check_headers,
    ("UpstreamConfig", "ca_file"): _check_ca_file,
    ("UpstreamConfig", "api_key_env"): _rule(  # never echoed: it may be a key pasted by mistake
        _ENV_NAME.fullmatch, "must be the NAME of an environment variable, not a key"
    ),
    ("RetryConfig", "statuses"): _check_statuses,
    ("BreakerConfig", "failure_statuses"): _check_statuses,
    ("RouteConfig", "path_prefix"): _rule(lambda v: v.startswith("/"), 'must start with "/"'),
    ("RouteConfig", "models"): _rule(
        lambda v: v and "" not in v,
        "must list non-empty model names (omit it to match any model)",
    ),
    ("RouteConfig", "match_headers"): _check_match_headers,
    ("RouteConfig", "candidates"): _rule(bool, "at least one candidate is required"),
    ("RouteConfig", "affinity_header"): _check_affinity_header,
    ("CandidateConfig", "model"): _rule(
        bool, "must not be empty (omit it to keep the body's model)"
    ),
    ("FleetConfig", "redis_url_env"): _rule(  # never echoed: it may be a URL pasted by mistake
        _ENV_NAME.fullmatch, "must be the NAME of an environment variable, not a URL"
    ),
    ("TracingConfig", "otlp_endpoint"): _check_otlp_endpoint,
    ("TracingConfig", "service_name"): _rule(
        lambda v: 0 < len(v) <= 255 and v.isprintable(), "must be 1..255 printable characters"
    ),
    ("FleetConfig", "key_prefix"): _rule(
        lambda v: 0 < len(v) <= 64 and v.isprintable() and not any(c.isspace() for c in v),
        "must be 1..64 printable characters without spaces",
    ),
}


def cross_check(raw: dict[str, Any], errors: list[Err]) -> None:
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
        listed = [c for c in cands if isinstance(c, dict)] if isinstance(cands, list) else []
        for j, cand in enumerate(listed):
            up = cand.get("upstream")
            if isinstance(up, str) and isinstance(ups, dict) and up not in ups:
                p = f"routes[{i}].candidates[{j}].upstream"
                errors.append((p, f"no upstream named {json.dumps(up)}"))
        _check_tiers(route, listed, i, errors)


def _check_tiers(
    route: dict[str, Any], cands: list[dict[str, Any]], i: int, errors: list[Err]
) -> None:
    """Contract: when any candidate sets ``tier``, every one of them must; and one target
    (upstream, model) is listed once per route (each member is its own breaker target)."""
    tiered = [j for j, c in enumerate(cands) if "tier" in c]
    if route.get("affinity_header") is not None and not tiered:
        errors.append(
            (
                f"routes[{i}].affinity_header",
                "needs candidates with a tier: sessions keep to one member of a tier",
            )
        )
    if tiered:
        for j, cand in enumerate(cands):
            if "tier" not in cand:
                errors.append(
                    (
                        f"routes[{i}].candidates[{j}].tier",
                        f"is required: candidates[{tiered[0]}] sets a tier, so every "
                        "candidate of this route must",
                    )
                )
    seen: dict[tuple[object, object], int] = {}
    for j, cand in enumerate(cands):
        key = (cand.get("upstream"), cand.get("model"))
        if key in seen and tiered:
            errors.append(
                (
                    f"routes[{i}].candidates[{j}]",
                    f"the same upstream and model as candidates[{seen[key]}]: a tier's "
                    "members are distinct targets",
                )
            )
        seen.setdefault(key, j)

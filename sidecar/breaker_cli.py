"""``sidecar breaker open|close|auto UPSTREAM MODEL``: an operator's override from a shell.

It calls a running sidecar's ``POST /breakers/{upstream}/{model}`` (contract, "The admin
port"): ``open`` is ``force_open``, ``close`` is ``force_closed``, ``auto`` hands the
target back to its breaker. The token is read from the variable the config names
(``server.admin_token_env``; the config found as for ``serve``: ``--config``, else
``SIDECAR_CONFIG``, ...), the address from ``server.admin_listen`` (a wildcard address
is reached on loopback) unless ``--admin URL`` is given.

Exit codes (``docs/overrides.md``): 0 done; 2 usage or config (a bad duration, no
``admin_token_env`` or its variable unset); 3 the admin port cannot be reached
(refused, timed out); 4 401, the token was refused; 5 404, the endpoint is off on that
sidecar (its variable unset there) or the target has no breaker; 1 anything else (a 400
names what was wrong).
"""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from sidecar.config import Config, split_host_port
from sidecar.override_request import MAX_FOR_MS

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_UNREACHABLE, EXIT_UNAUTHORIZED, EXIT_NOT_FOUND = 3, 4, 5
VERBS = {"open": "force_open", "close": "force_closed", "auto": "auto"}
"""The CLI's verbs and the endpoint's actions."""
TIMEOUT_S = 10.0
"""Longest wait for the admin port's answer."""

_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_PART = re.compile(r"(\d+)(ms|s|m|h|d)")


def parse_duration_ms(text: str) -> int:
    """``90s``, ``10m``, ``2h``, ``1500ms``, ``1d``, or a sum such as ``1h30m``, in
    milliseconds (> 0, at most a year: the endpoint's bound,
    :data:`sidecar.override_request.MAX_FOR_MS`).

    :raises ValueError: anything else: a bare number (its unit is unclear), an upper-case
        unit (``10M`` reads as months), a duration past a year.
    """
    s = text.strip()
    pos, total = 0, 0
    while pos < len(s):
        m = _PART.match(s, pos)
        if m is None:
            raise ValueError(f"{text!r} is not a duration such as 90s, 10m, 2h or 1500ms")
        total += int(m.group(1)) * _UNIT_MS[m.group(2)]
        pos = m.end()
    if total <= 0:
        raise ValueError(f"{text!r} is not a duration > 0 (such as 90s, 10m, 2h or 1500ms)")
    if total > MAX_FOR_MS:
        raise ValueError(f"{text!r} is a duration past a year (an override's longest --for)")
    return total


def admin_base_url(config: Config) -> str:
    """``http://host:port`` of ``server.admin_listen``; a wildcard address (``0.0.0.0``,
    ``::``, empty) is reached on loopback."""
    host, port = split_host_port(config.server.admin_listen)
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""The opener of the admin request: never through ``HTTP_PROXY`` (urllib's default reads
it from the environment, where an egress-proxied sidecar has it, and it would carry the
``Authorization: Bearer`` token in clear to the proxy): the admin port is reached as
given, directly."""


def breaker_url(base: str, upstream: str, model: str) -> str:
    """The endpoint of one target; ``*`` and ``/`` in a model are percent-encoded."""
    return f"{base.rstrip('/')}/breakers/{quote(upstream, safe='')}/{quote(model, safe='')}"


def describe(entry: Mapping[str, Any]) -> str:
    """One line for a human: the target, its override (or none) and its state."""
    target = f"{entry.get('upstream')}/{entry.get('model')}"
    ov = entry.get("override")
    state = f"state {entry.get('state')}, {entry.get('consecutive_failures')} failures counted"
    if not isinstance(ov, dict):
        return f"{target}: back to its breaker's own rules ({state})"
    until = ov.get("until") or "auto"
    return f"{target}: {ov.get('action')} until {until} ({state}); reason: {ov.get('reason')}"


def run(
    verb: str,
    upstream: str,
    model: str,
    *,
    config: Config,
    environ: Mapping[str, str],
    reason: str | None,
    for_: str | None,
    admin: str | None,
    as_json: bool,
) -> int:
    """Send the override and print the answer; returns the exit code (module docstring).
    Errors go to stderr, each naming what to do; the token is never printed."""
    body: dict[str, Any] = {"action": VERBS[verb]}
    if reason is not None:
        body["reason"] = reason
    if for_ is not None:
        if verb == "auto":
            return _fail(EXIT_USAGE, "--for applies to open and close only")
        try:
            body["for_ms"] = parse_duration_ms(for_)
        except ValueError as exc:
            return _fail(EXIT_USAGE, f"--for: {exc}")
    var = config.server.admin_token_env
    if not var:
        return _fail(
            EXIT_USAGE,
            "server.admin_token_env is not set in the config: the sidecar takes no overrides "
            "(set it to the name of the variable holding the admin token)",
        )
    token = environ.get(var)
    if not token:
        return _fail(EXIT_USAGE, f"server.admin_token_env: variable {var} is not set or empty")
    url = breaker_url(admin or admin_base_url(config), upstream, model)
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with _DIRECT.open(request, timeout=TIMEOUT_S) as resp:
            entry = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return _http_error(exc, upstream, model, var)
    except (urllib.error.URLError, OSError) as exc:
        why = getattr(exc, "reason", exc)
        return _fail(EXIT_UNREACHABLE, f"cannot reach the admin port at {url}: {why}")
    print(json.dumps(entry) if as_json else describe(entry))
    return EXIT_OK


def _http_error(exc: urllib.error.HTTPError, upstream: str, model: str, var: str) -> int:
    try:
        doc = json.loads(exc.read())
        message = str(doc["error"]["message"])
        code = str(doc["error"]["code"])
    except (ValueError, KeyError, TypeError):
        message, code = "", ""
    if exc.code == 401:
        return _fail(EXIT_UNAUTHORIZED, f"401: the sidecar refused the token in {var}")
    if exc.code == 404 and code == "unknown_target":
        return _fail(EXIT_NOT_FOUND, f"404: {message}")
    if exc.code == 404:
        return _fail(
            EXIT_NOT_FOUND,
            "404: that sidecar has no override endpoint (its server.admin_token_env "
            "variable is unset or empty there)",
        )
    return _fail(EXIT_FAILURE, f"{exc.code}: {message or exc.reason}")


def _fail(code: int, message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code

"""The one builder of sidecar configs for the tests: TOML text from keyword arguments.

A test says which keys it needs and gets the config file's text, the same text
``sidecar serve --config`` reads. The TOML is written by ``tomli_w`` (not by string
templates), so a value is always quoted and escaped right; the result is parsed back
with ``tomllib`` before it is returned, so a builder mistake fails at the call.

- ``upstream(base_url, retry=..., circuit_breaker=..., **keys)``: one
  ``[upstreams.<name>]`` table (keys as in ``docs/interface.md``);
- ``route(name, *candidates, **keys)``: one ``[[routes]]`` entry, a candidate given
  as an upstream name (``{ upstream = name }``) or as a full table;
- ``config(upstreams=..., routes=..., server=..., extra=..., **sections)``: the file;
  ``extra`` is raw TOML merged in (a key it repeats is an error), for what the keyword
  form does not say;
- ``single(base_url, ...)``: the common shape, one upstream ``primary`` under one
  route ``chat`` on ``/v1/``;
- ``fallback(primary_url, backup_url, ...)``: upstream ``primary`` then ``backup``
  under one route ``chat`` on ``/v1/``;
- ``route_table(base_url, rows)``: routing tables, one upstream ``up_<name>`` and one
  route ``<name>`` over it per row.

Configs a test needs to be malformed (unknown keys are fine here, TOML syntax errors
are not) stay raw TOML text in that test.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

import tomli_w

__all__ = ["config", "fallback", "route", "route_table", "single", "upstream"]

Table = dict[str, Any]


def upstream(
    base_url: str,
    *,
    retry: Mapping[str, Any] | None = None,
    circuit_breaker: Mapping[str, Any] | None = None,
    **keys: Any,
) -> Table:
    """One upstream table: ``base_url``, then ``keys`` (e.g. ``max_connections=1``,
    ``first_byte_timeout_ms=50``), then the ``retry`` / ``circuit_breaker`` sub-tables
    when given (milliseconds where the key says ``_ms``, as in the contract)."""
    table: Table = {"base_url": base_url, **keys}
    if retry is not None:
        table["retry"] = dict(retry)
    if circuit_breaker is not None:
        table["circuit_breaker"] = dict(circuit_breaker)
    return table


def route(name: str, *candidates: str | Mapping[str, Any], **keys: Any) -> Table:
    """One ``[[routes]]`` entry: ``name``, ``keys`` (e.g. ``path_prefix="/v1/"``,
    ``match_headers={...}``) and ``candidates`` in order; a ``str`` candidate is
    ``{ upstream = <it> }``, a mapping is taken as the whole candidate table."""
    listed = [{"upstream": c} if isinstance(c, str) else dict(c) for c in candidates]
    return {"name": name, **keys, "candidates": listed}


def config(
    *,
    upstreams: Mapping[str, Mapping[str, Any]] | None = None,
    routes: Sequence[Mapping[str, Any]] = (),
    server: Mapping[str, Any] | None = None,
    extra: str = "",
    **sections: Any,
) -> str:
    """The config file's TOML text. ``sections`` are further top-level tables (e.g.
    ``admin={...}``, ``logging={...}``); ``extra`` is raw TOML deep-merged in last.

    Raises ``ValueError`` when ``extra`` sets a key the keyword form already set, and
    ``tomllib.TOMLDecodeError`` when ``extra`` is not TOML.
    """
    doc: Table = {}
    if server is not None:
        doc["server"] = dict(server)
    doc.update(sections)
    if upstreams is not None:
        doc["upstreams"] = {name: dict(table) for name, table in upstreams.items()}
    if routes:
        doc["routes"] = [dict(r) for r in routes]
    if extra:
        _merge(doc, tomllib.loads(extra), "")
    text = tomli_w.dumps(doc)
    tomllib.loads(text)
    return text


def single(
    base_url: str,
    *,
    server: Mapping[str, Any] | None = None,
    retry: Mapping[str, Any] | None = None,
    circuit_breaker: Mapping[str, Any] | None = None,
    route_name: str = "chat",
    path_prefix: str | None = "/v1/",
    extra: str = "",
    **upstream_keys: Any,
) -> str:
    """One upstream ``primary`` (``upstream_keys``, ``retry``, ``circuit_breaker``) and
    one route ``route_name`` over it (on ``path_prefix``; ``None`` leaves the key out)."""
    keys: Table = {} if path_prefix is None else {"path_prefix": path_prefix}
    return config(
        server=server,
        upstreams={
            "primary": upstream(
                base_url, retry=retry, circuit_breaker=circuit_breaker, **upstream_keys
            )
        },
        routes=[route(route_name, "primary", **keys)],
        extra=extra,
    )


def fallback(
    primary_url: str,
    backup_url: str,
    *,
    server: Mapping[str, Any] | None = None,
    primary: Mapping[str, Any] | None = None,
    backup: Mapping[str, Any] | None = None,
) -> str:
    """Upstream ``primary`` (keys ``primary``, e.g. ``{"retry": {"max_retries": 2}}``)
    then ``backup`` (keys ``backup``) as the candidates, in that order, of one route
    ``chat`` on ``/v1/``."""
    return config(
        server=server,
        upstreams={
            "primary": upstream(primary_url, **(primary or {})),
            "backup": upstream(backup_url, **(backup or {})),
        },
        routes=[route("chat", "primary", "backup", path_prefix="/v1/")],
    )


def route_table(base_url: str, rows: Sequence[tuple[Any, ...]]) -> str:
    """Rows ``(name, path_prefix, models, match_headers)`` (the last may be left out;
    ``None`` leaves ``models`` / ``match_headers`` out), in file order: an upstream
    ``up_<name>`` at ``base_url`` for each, and a route ``<name>`` whose one candidate
    is it."""
    routes = []
    for name, prefix, models, *rest in rows:
        keys: Table = {"path_prefix": prefix}
        if models is not None:
            keys["models"] = models
        if rest and rest[0] is not None:
            keys["match_headers"] = rest[0]
        routes.append(route(name, f"up_{name}", **keys))
    return config(upstreams={f"up_{row[0]}": upstream(base_url) for row in rows}, routes=routes)


def _merge(into: Table, more: Mapping[str, Any], where: str) -> None:
    """Deep-merge ``more`` into ``into``; tables merge, anything else set twice raises."""
    for key, value in more.items():
        here = f"{where}.{key}" if where else key
        old = into.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            _merge(old, value, here)
        elif key in into:
            raise ValueError(f"config key {here!r} set twice")
        else:
            into[key] = value

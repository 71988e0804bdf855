"""``SIDECAR__`` environment overrides (pure): merged into the raw TOML mapping before decoding.

``SIDECAR__`` environment overrides, merged into the raw TOML mapping before decoding.
``SIDECAR__<SECTION>__<KEY>[__<KEY>...]`` sets one key: the name after the prefix is
split on ``__`` and lower-cased (``SIDECAR__UPSTREAMS__OPENAI__RETRY__MAX_RETRIES=5``
sets ``upstreams.openai.retry.max_retries``). Missing tables are created (an override
can add an upstream or a ``circuit_breaker`` table); inside a list (``routes``,
``candidates``) a part is an index into the existing list (``SIDECAR__ROUTES__0__...``).
The value is read as a TOML value (``5000``, ``true``, ``[429, 503]``, ``"x"``) and kept
as the raw string when it is not valid TOML (``0.0.0.0:8080``) or when the key is
declared as a string (so ``...__MODEL=4`` stays ``"4"``). ``SIDECAR_CONFIG`` (one
underscore) is the config path, not an override.
"""

import tomllib
import typing
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from sidecar.config.decode import Err, join_path, unwrap

PREFIX = "SIDECAR__"


def apply_env_overrides(
    raw: dict[str, Any], environ: Mapping[str, str], schema: type
) -> tuple[dict[str, str], list[Err]]:
    """Merge every ``SIDECAR__`` variable of ``environ`` into ``raw`` (mutated in place).

    :param schema: the root Struct type, used only to keep values of string keys raw.
    :returns: (key path -> variable name, errors). An error names its key path and
        the variable; variables are applied parents first, so
        ``SIDECAR__UPSTREAMS__X={...}`` then ``SIDECAR__UPSTREAMS__X__RETRY__...``.
    """
    errors: list[Err] = []
    items: list[tuple[list[str], str, str]] = []
    for name, value in environ.items():
        if not name.upper().startswith(PREFIX):
            continue
        segs = name[len(PREFIX) :].lower().split("__")
        if not all(segs):
            errors.append((name, "malformed override name: empty key between '__'"))
            continue
        items.append((segs, name, value))
    origins: dict[str, str] = {}
    for segs, name, value in sorted(items):
        path, err = _set(raw, segs, _typed(value, _leaf_type(schema, segs)))
        if err is not None:
            errors.append((path, f"{err} (from {name})"))
            continue
        if path in origins:
            errors.append((path, f"also set by {origins[path]}"))
        origins[path] = name
    return origins, errors


def _set(raw: dict[str, Any], segs: list[str], value: object) -> tuple[str, str | None]:
    """Set ``value`` at ``segs``; returns (key path, error message or None)."""
    node: Any = raw
    path = ""
    for i, seg in enumerate(segs):
        key: int | str
        if isinstance(node, list):
            if not (seg.isascii() and seg.isdigit()):
                return path, "is a list: the next name part must be an index (0, 1, ...)"
            key, path = int(seg), f"{path}[{seg}]"
            if key >= len(node):
                return path, f"no such entry (the list has {len(node)})"
        elif isinstance(node, dict):
            key, path = seg, join_path(path, seg)
        else:
            return path, "is not a table: cannot set a key inside it"
        if i == len(segs) - 1:
            node[key] = value
        else:
            if isinstance(node, dict) and key not in node:
                node[key] = {}
            node = node[key]
    return path, None


def _typed(value: str, tp: Any) -> object:
    """The TOML reading of ``value``, else the raw string; raw too for string keys."""
    try:
        parsed = tomllib.loads("v = " + value)
    except tomllib.TOMLDecodeError:
        return value
    if set(parsed) != {"v"}:
        return value
    if _is_str(tp) and not isinstance(parsed["v"], str):
        return value
    return parsed["v"]


def _leaf_type(schema: Any, segs: list[str]) -> Any:
    """The declared type at a key path, or None when the path is not in the schema."""
    tp = schema
    for seg in segs:
        tp = unwrap(tp)
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            tp = typing.get_type_hints(tp, include_extras=True).get(seg)
        elif origin is dict:
            tp = typing.get_args(tp)[1]
        elif origin is tuple:
            tp = typing.get_args(tp)[0]
        else:
            return None
    return tp


def _is_str(tp: Any) -> bool:
    tp = unwrap(tp)
    if typing.get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    return tp is str

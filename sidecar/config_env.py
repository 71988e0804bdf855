"""Schema-agnostic machinery behind :mod:`sidecar.config`.

- ``SIDECAR__`` environment overrides, merged into the raw TOML mapping before decoding.
  ``SIDECAR__<SECTION>__<KEY>[__<KEY>...]`` sets one key: the name after the prefix is
  split on ``__`` and lower-cased (``SIDECAR__UPSTREAMS__OPENAI__RETRY__MAX_RETRIES=5``
  sets ``upstreams.openai.retry.max_retries``). Missing tables are created (an override
  can add an upstream or a ``circuit_breaker`` table); inside a list (``routes``,
  ``candidates``) a part is an index into the existing list (``SIDECAR__ROUTES__0__...``).
  The value is read as a TOML value (``5000``, ``true``, ``[429, 503]``, ``"x"``) and kept
  as the raw string when it is not valid TOML (``0.0.0.0:8080``) or when the key is
  declared as a string (so ``...__MODEL=4`` stays ``"4"``). ``SIDECAR_CONFIG`` (one
  underscore) is the config path, not an override.
- Strict decoding of a raw mapping into msgspec Structs *field by field*, so that every
  error is collected, each with its key path (``routes[0].candidates[1].upstream``).
- A small TOML writer (``msgspec.toml.encode`` needs ``tomli_w``, not a dependency).
"""

import json
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Literal, TypeVar, Union

import msgspec

PREFIX = "SIDECAR__"
Err = tuple[str, str]
"""One error: (dotted key path, message)."""
Check = Callable[[Any, str, list[Err]], Any]
"""A field rule: (decoded value, key path, errors) -> the value to keep (maybe normalised)."""
_S = TypeVar("_S", bound=msgspec.Struct)

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def join_path(path: str, key: str) -> str:
    """``path.key``, quoting the key as TOML does when it is not a bare key."""
    k = key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)
    return f"{path}.{k}" if path else k


def describe(errors: list[Err], origins: Mapping[str, str]) -> list[str]:
    """Render errors as ``path: message``, naming the variable behind an overridden key.

    :param origins: key path -> name of the ``SIDECAR__`` variable that set it.
    """
    out = []
    for path, msg in errors:
        hits = [p for p in origins if path == p or path.startswith((p + ".", p + "["))]
        if hits:
            msg = f"{msg} (from {origins[max(hits, key=len)]})"
        out.append(f"{path}: {msg}")
    return out


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


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` down to ``X``."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _leaf_type(schema: Any, segs: list[str]) -> Any:
    """The declared type at a key path, or None when the path is not in the schema."""
    tp = schema
    for seg in segs:
        tp = _unwrap(tp)
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
    tp = _unwrap(tp)
    if typing.get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    return tp is str


# ---- strict decoding ------------------------------------------------------------

_NAMES = {
    **{"int": "an integer", "str": "a string", "bool": "a boolean", "float": "a float"},
    **{"array": "an array", "object": "a table", "dict": "a table", "list": "an array"},
}


def _kind(v: object) -> str:
    return _NAMES.get(type(v).__name__, f"a {type(v).__name__}")


def _plain(msg: str) -> str:
    """msgspec's wording -> plain words: "Expected `int` >= 1" -> "must be > 0"."""
    if m := re.fullmatch(r"Expected `\w+` (>=|<=|>|<) (-?\d+)", msg):
        return "must be > 0" if m.groups() == (">=", "1") else f"must be {m[1]} {m[2]}"
    if m := re.fullmatch(r"Expected `(.+)`, got `(\w+)`", msg):
        want = [_NAMES.get(t, f"a {t}") for t in m[1].split(" | ") if t != "null"]
        return f"expected {' or '.join(want)}, got {_NAMES.get(m[2], 'a ' + m[2])}"
    return msg[:1].lower() + msg[1:]


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def decode_struct(
    raw: object,
    cls: type[_S],
    path: str,
    errors: list[Err],
    checks: Mapping[tuple[type, str], Check],
) -> _S | None:
    """Decode one table field by field into ``cls``, appending every error to ``errors``.

    ``checks[(cls, field)]`` runs on a field that decoded cleanly. Returns None when
    any error was found in this table or below it.
    """
    if not isinstance(raw, dict):
        errors.append((path, f"expected a table, got {_kind(raw)}"))
        return None
    n, values = len(errors), {}
    for key, val in raw.items():
        p = join_path(path, key)
        if key not in cls.__struct_fields__:
            errors.append((p, "unknown key"))
            continue
        before = len(errors)
        value = _decode_value(val, _hints(cls)[key], p, errors, checks)
        if len(errors) == before and (check := checks.get((cls, key))) is not None:
            value = check(value, p, errors)
        values[key] = value
    for f in msgspec.structs.fields(cls):
        if f.required and f.name not in raw:
            errors.append((join_path(path, f.name), "required key is missing"))
    return cls(**values) if len(errors) == n else None


def _decode_value(
    val: object, tp: Any, path: str, errors: list[Err], checks: Mapping[tuple[type, str], Check]
) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return _decode_value(val, _unwrap(tp), path, errors, checks)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return decode_struct(val, tp, path, errors, checks)
    if origin is tuple:
        if not isinstance(val, list):
            errors.append((path, f"expected an array, got {_kind(val)}"))
            return None
        return tuple(
            _decode_value(v, args[0], f"{path}[{i}]", errors, checks) for i, v in enumerate(val)
        )
    if origin is dict:
        if not isinstance(val, dict):
            errors.append((path, f"expected a table, got {_kind(val)}"))
            return None
        return {
            k: _decode_value(v, args[1], join_path(path, k), errors, checks) for k, v in val.items()
        }
    if origin is Literal:
        if isinstance(val, str) and val in args:
            return val
        errors.append((path, "must be one of " + ", ".join(json.dumps(a) for a in args)))
        return None
    try:
        return msgspec.convert(val, tp)
    except msgspec.ValidationError as e:
        msg, _, at = str(e).partition(" - at `$")
        errors.append((path + at.rstrip("`"), _plain(msg)))
        return None


# ---- TOML writing -----------------------------------------------------------------


def toml_dumps(data: Mapping[str, Any]) -> str:
    """Builtins (``msgspec.to_builtins`` output) as TOML text; None values are left out."""
    out: list[str] = []
    _emit(data, [], out)
    return "\n".join(out).lstrip("\n") + "\n"


def _emit(table: Mapping[str, Any], prefix: list[str], out: list[str], array: bool = False) -> None:
    scalars = {k: v for k, v in table.items() if v is not None and not (isinstance(v, dict) and v)}
    if prefix and (scalars or array):
        name = ".".join(_key(p) for p in prefix)
        out.extend(["", f"[[{name}]]" if array else f"[{name}]"])
    out.extend(f"{_key(k)} = {_value(v)}" for k, v in scalars.items() if not _aot(prefix, v))
    for k, v in table.items():
        if isinstance(v, dict) and v:
            _emit(v, [*prefix, k], out)
        elif _aot(prefix, v):
            for item in v:
                _emit(item, [*prefix, k], out, array=True)


def _aot(prefix: list[str], v: object) -> bool:
    """Top-level lists of tables (``routes``) are written as ``[[name]]`` sections."""
    return (
        not prefix
        and isinstance(v, list | tuple)
        and bool(v)
        and all(isinstance(x, dict) for x in v)
    )


def _key(k: str) -> str:
    return join_path("", k)


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = [f"{_key(k)} = {_value(x)}" for k, x in v.items() if x is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise TypeError(f"cannot render {type(v).__name__} as TOML")

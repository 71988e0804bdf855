"""Strict decoding of a raw config mapping into msgspec Structs, field by field (pure).

Every error is collected, each with its dotted key path
(``routes[0].candidates[1].upstream``), so that ``check-config`` lists them all; a
field rule (:data:`Check`) runs on each field that decoded cleanly.
"""

import difflib
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Literal, TypeVar, Union

import msgspec

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


def describe(
    errors: list[Err], origins: Mapping[str, str], created: Mapping[str, str] | None = None
) -> list[str]:
    """Render errors as ``path: message``, naming the variable behind an overridden key.

    :param origins: key path -> name of the ``SIDECAR__`` variable that set it.
    :param created: table path -> a note on the override that created that table (it is
        not in the file), added to an error inside it that no variable in ``origins`` set
        (``upstreams.primry.base_url: required key is missing (upstreams.primry is not in
        the config file: SIDECAR__UPSTREAMS__PRIMRY__API_KEY_ENV created it ...)``).
    """
    out = []
    for path, msg in errors:
        hits = [p for p in origins if _under(path, p)]
        if hits:
            msg = f"{msg} (from {origins[max(hits, key=len)]})"
        elif tables := [p for p in created or () if _under(path, p)]:
            note = (created or {})[max(tables, key=len)]
            if "; did you mean" in msg and "did you mean" in note:
                msg = msg.split("; did you mean", 1)[0]  # the note's hint names the variable too
            msg = f"{msg} ({note})"
        out.append(f"{path}: {msg}")
    return out


def _under(path: str, table: str) -> bool:
    """True when key path ``path`` is ``table`` or inside it."""
    return path == table or path.startswith((table + ".", table + "["))


def unwrap(tp: Any) -> Any:
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
    checks: Mapping[tuple[str, str], Check],
) -> _S | None:
    """Decode one table field by field into ``cls``, appending every error to ``errors``.

    ``checks[(cls.__name__, field)]`` runs on a field that decoded cleanly. Returns None when
    any error was found in this table or below it.
    """
    if not isinstance(raw, dict):
        errors.append((path, f"expected a table, got {_kind(raw)}"))
        return None
    n, values = len(errors), {}
    for key, val in raw.items():
        p = join_path(path, key)
        if key not in cls.__struct_fields__:
            errors.append((p, unknown_key_message(cls, key, val)))
            continue
        before = len(errors)
        value = _decode_value(val, _hints(cls)[key], p, errors, checks)
        if len(errors) == before and (check := checks.get((cls.__name__, key))) is not None:
            value = check(value, p, errors)
        values[key] = value
    for f in msgspec.structs.fields(cls):
        if f.required and f.name not in raw:
            errors.append((join_path(path, f.name), "required key is missing"))
    return cls(**values) if len(errors) == n else None


_SECRET_NAME = re.compile(r"key|token|secret|passw|credential|bearer", re.I)
_SECRET_VALUE = re.compile(
    r"(sk|pk|rk|xai|gsk|hf|ghp|glpat)[-_]\S{8,}|AIza\S{20,}|Bearer\s+\S+|\w+://[^/\s]*@", re.I
)
_ENV_NAME_VALUE = re.compile(r"[A-Z_][A-Z0-9_]*")


def looks_like_secret(key: str, value: object) -> bool:
    """True when ``key = value`` looks like a credential pasted into the file: a string
    in a known key format (``sk-...``, ``sk-ant-...``, ``AIza...``, ``Bearer ...``, a URL
    with ``user:password@``), or a key named like a secret (``api_key``, ``token``...)
    whose string value is not itself an environment variable's name."""
    if not isinstance(value, str) or not value:
        return False
    if _SECRET_VALUE.match(value.strip()):
        return True
    return bool(_SECRET_NAME.search(key)) and not _ENV_NAME_VALUE.fullmatch(value)


def unknown_key_message(cls: type[msgspec.Struct], key: str, value: object) -> str:
    """``unknown key``, with a hint: a sub-table of ``cls`` that has this very key
    (``circuit_breaker.slow_call_ms``), else the nearest key name of ``cls``
    (:func:`difflib.get_close_matches`, its default cutoff 0.6); and, when the
    value looks like a credential (:func:`looks_like_secret`), where secrets go: the
    ``*_env`` key of ``cls`` that names the variable holding one. Never echoes ``value``.
    """
    fields = cls.__struct_fields__
    homes = [
        f"{name}.{key}"
        for name in fields
        if isinstance(sub := unwrap(_hints(cls)[name]), type)
        and issubclass(sub, msgspec.Struct)
        and key in sub.__struct_fields__
    ]
    near = homes or difflib.get_close_matches(key, fields, n=1)
    msg = f"unknown key; did you mean {json.dumps(near[0])}?" if near else "unknown key"
    if looks_like_secret(key, value):
        envs = [f for f in fields if f.endswith("_env")]
        where = f": set {envs[0]} to the NAME of the variable that holds it" if envs else ""
        msg += f" (secrets never go in the config file, only in the environment{where})"
    return msg


def _decode_value(
    val: object, tp: Any, path: str, errors: list[Err], checks: Mapping[tuple[str, str], Check]
) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        # X | None with a value: decode as X, its Annotated constraints (``Meta``) kept
        inner = args[0] if args[1] is type(None) else args[1]
        return _decode_value(val, inner, path, errors, checks)
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

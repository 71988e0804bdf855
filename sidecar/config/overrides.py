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

import difflib
import json
import tomllib
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, NamedTuple

import msgspec

from sidecar.config.decode import Err, join_path, unwrap

PREFIX = "SIDECAR__"


class CreatedTable(NamedTuple):
    """A table an override created because the file does not have it."""

    path: str
    """Its key path (``upstreams.primry``)."""
    variable: str
    """The variable that created it (the first one, in name order)."""
    near: str | None
    """The file's key beside it that its name is closest to (``primary``), or None."""
    near_variable: str | None
    """``variable`` with ``near`` in place of the new table's name, or None."""

    def note(self) -> str:
        """``not in the config file: SIDECAR__UPSTREAMS__PRIMRY__BASE_URL created it; did
        you mean "primary" (SIDECAR__UPSTREAMS__PRIMARY__BASE_URL)?``"""
        text = f"not in the config file: {self.variable} created it"
        if self.near is not None:
            text += f"; did you mean {json.dumps(self.near)} ({self.near_variable})?"
        return text


class Overrides(NamedTuple):
    """What :func:`apply_env_overrides` did."""

    origins: dict[str, str]
    """Key path -> name of the variable that set it."""
    errors: list[Err]
    """Problems, each naming its key path and the variable."""
    created: dict[str, CreatedTable]
    """Table path -> the table an override created (it was not in the file):
    ``upstreams.primry`` for ``SIDECAR__UPSTREAMS__PRIMRY__BASE_URL``, a typo as often
    as not, which error messages and :mod:`sidecar.config.lint` point out."""


def apply_env_overrides(raw: dict[str, Any], environ: Mapping[str, str], schema: type) -> Overrides:
    """Merge every ``SIDECAR__`` variable of ``environ`` into ``raw`` (mutated in place).

    :param schema: the root Struct type, used only to keep values of string keys raw.
    :returns: the key paths set, the errors and the tables created (:class:`Overrides`).
        An error names its key path and the variable; variables are applied parents
        first, so ``SIDECAR__UPSTREAMS__X={...}`` then ``SIDECAR__UPSTREAMS__X__RETRY__...``.
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
    created: dict[str, CreatedTable] = {}
    for segs, name, value in sorted(items):
        path, err, new_tables = _set(raw, segs, _typed(value, _leaf_type(schema, segs)))
        for table, i, siblings in new_tables:
            file_keys = [
                k for k in siblings if join_path(table.rpartition(".")[0], k) not in created
            ]
            near = next(iter(difflib.get_close_matches(segs[i], file_keys, n=1)), None)
            near_var = None
            if near is not None:
                near_var = PREFIX + "__".join([*segs[:i], near, *segs[i + 1 :]]).upper()
            created.setdefault(table, CreatedTable(table, name, near, near_var))
        if err is not None:
            errors.append((path, f"{err} (from {name})"))
            continue
        if path in origins:
            errors.append((path, f"also set by {origins[path]}"))
        origins[path] = name
    return Overrides(origins, errors, created)


def _set(
    raw: dict[str, Any], segs: list[str], value: object
) -> tuple[str, str | None, list[tuple[str, int, list[str]]]]:
    """Set ``value`` at ``segs``; returns (key path, error message or None, the tables
    created on the way: (path, index of its name in ``segs``, the keys beside it))."""
    node: Any = raw
    path = ""
    created: list[tuple[str, int, list[str]]] = []
    for i, seg in enumerate(segs):
        key: int | str
        if isinstance(node, list):
            if not (seg.isascii() and seg.isdigit()):
                return path, "is a list: the next name part must be an index (0, 1, ...)", created
            key, path = int(seg), f"{path}[{seg}]"
            if key >= len(node):
                return path, f"no such entry (the list has {len(node)})", created
        elif isinstance(node, dict):
            key, path = seg, join_path(path, seg)
        else:
            return path, "is not a table: cannot set a key inside it", created
        if i == len(segs) - 1:
            if isinstance(node, dict) and key not in node and isinstance(value, dict):
                created.append((path, i, [k for k in node if isinstance(k, str)]))
            node[key] = value
        else:
            if isinstance(node, dict) and key not in node:
                created.append((path, i, [k for k in node if isinstance(k, str)]))
                node[key] = {}
            node = node[key]
    return path, None, created


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


def near_misses(environ: Mapping[str, str], sections: Iterable[str]) -> list[Err]:
    """``(variable, message)`` for each variable that looks meant as an override but is
    not one, so it is ignored: ``SIDECAR_UPSTREAMS__...`` (one underscore after
    ``SIDECAR``) where a section of the config follows. (``SIDECAR___...`` is an
    override of an unknown key, an error.)

    :param sections: the root table's key names (``server``, ``upstreams``, ...).
    """
    out: list[Err] = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("SIDECAR_") or upper.startswith(PREFIX):
            continue
        first = upper[len("SIDECAR_") :].split("__", 1)[0].lower()
        if first in sections:
            out.append((name, f"ignored: an override starts with {PREFIX} (two underscores)"))
    return out

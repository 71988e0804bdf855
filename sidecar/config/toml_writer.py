"""A small TOML writer for the effective config (``msgspec.toml.encode`` needs ``tomli_w``,
not a dependency)."""

import json
from collections.abc import Mapping
from typing import Any

from sidecar.config.decode import join_path


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

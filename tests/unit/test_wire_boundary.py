"""What the sidecar takes from aiohttp's insides stays behind one door: ``sidecar.wire``.

Policy modules import no private aiohttp module; every private attribute the wire
reads or writes on an aiohttp object is listed in ``sidecar/wire/__init__.py``'s
inventory (so a reviewer, or an aiohttp upgrade, finds them all in one place).
"""

from __future__ import annotations

import ast
from pathlib import Path

import sidecar.wire

ROOT = Path(__file__).resolve().parents[2] / "sidecar"
WIRE = ROOT / "wire"
PUBLIC_SUBMODULES = {"http_exceptions"}
"""aiohttp submodules a policy module may import from (documented exception types)."""


def modules(under: Path) -> list[Path]:
    return sorted(p for p in under.rglob("*.py"))


def test_policy_modules_import_no_private_aiohttp_module() -> None:
    offenders = []
    for path in modules(ROOT):
        if WIRE in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == "aiohttp" and len(parts) > 1 and parts[1] not in PUBLIC_SUBMODULES:
                    offenders.append(f"{path.relative_to(ROOT)}: from {node.module}")
    assert offenders == []


def test_every_private_name_the_wire_uses_is_in_its_inventory() -> None:
    inventory = sidecar.wire.__doc__ or ""
    missing = set()
    for path in modules(WIRE):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                # our own module-level helpers (``_watcher``...) are not aiohttp's
                if isinstance(node.value, ast.Name) and node.value.id[:1].isupper():
                    continue
                if f"``{node.attr}``" not in inventory:
                    missing.add(f"{path.name}: .{node.attr}")
    assert missing == set()


def test_the_wire_package_is_where_its_modules_are() -> None:
    assert {p.stem for p in modules(WIRE)} == {
        "__init__", "downstream", "pool", "push_pump", "upstream_call", "upstream_request",
        "whole_answer",
    }  # fmt: skip


def test_private_names_a_wire_class_reads_on_its_aiohttp_base_are_in_the_inventory() -> None:
    """``self._x`` inside a wire class that subclasses an aiohttp class is aiohttp's own
    private state when an aiohttp class of its MRO defines or assigns ``_x``."""
    import importlib
    import inspect

    inventory = sidecar.wire.__doc__ or ""
    missing = set()
    for path in modules(WIRE):
        module = importlib.import_module(
            f"sidecar.wire.{path.stem}" if path.stem != "__init__" else "sidecar.wire"
        )
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(module, node.name, None)
            bases = [
                b for b in getattr(cls, "__mro__", ())[1:] if b.__module__.startswith("aiohttp")
            ]
            sources = "\n".join(inspect.getsource(b) for b in bases)
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                    and sub.attr.startswith("_")
                    and not sub.attr.startswith("__")
                    and (f"self.{sub.attr}" in sources or f"def {sub.attr}(" in sources)
                    and f"``{sub.attr}``" not in inventory
                ):
                    missing.add(f"{path.name}: {node.name}.{sub.attr}")
    assert missing == set()

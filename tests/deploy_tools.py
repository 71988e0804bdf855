"""The operator tools in ``deploy/tools/`` (scripts, not a package), imported by the tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "deploy" / "tools"


def load_tool(name: str) -> ModuleType:
    """Import ``deploy/tools/<name>.py`` (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(f"deploy_tools_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

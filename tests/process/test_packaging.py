"""What the installed distribution says about itself: its licence, its name, its command."""

from __future__ import annotations

from importlib.metadata import distribution, packages_distributions
from pathlib import Path

DIST = "llm-circuit-sidecar"
ROOT = Path(__file__).resolve().parents[2]


def test_installed_metadata_says_apache_2() -> None:
    meta = distribution(DIST).metadata
    # PEP 639 (core metadata 2.4): the SPDX expression, and the licence file shipped.
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])


def test_licence_file_is_the_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_distribution_name_is_its_own_and_keeps_the_sidecar_package_and_command() -> None:
    # `sidecar` on PyPI is an unrelated package that also installs a `sidecar` module.
    dist = distribution(DIST)
    assert dist.metadata["Name"] == "llm-circuit-sidecar"
    assert DIST in packages_distributions()["sidecar"]
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"sidecar": "sidecar.cli:main"}

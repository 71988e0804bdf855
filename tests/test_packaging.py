"""What the installed distribution says about itself: its licence, its name, its command."""

from __future__ import annotations

from importlib.metadata import distribution
from pathlib import Path

DIST = "sidecar"
ROOT = Path(__file__).resolve().parent.parent


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

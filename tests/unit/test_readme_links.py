"""README.md and the docs it sends readers to: every link lands, every path named exists.

A relative Markdown link (``[text](docs/x.md#anchor)``) must name an existing file
and, with an anchor, a heading of that file as GitHub slugs it; a repository path in
backticks (``deploy/k8s/podmonitor.yaml``) must exist; the README's contents list
links every ``##`` section. Moving text between README.md and ``docs/`` (issue 23)
must not leave a dead reference behind.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.readme_blocks import README, ROOT

DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH_RE = re.compile(r"`((?:\.?[\w-]+/)+[\w.-]*)`")
FENCE_RE = re.compile(r"^\s*```")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE_RE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to ``-``."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found = re.findall(r"^#+ (.+)$", prose(path.read_text()), re.MULTILINE)
    return {slug(h) for h in found}


def test_slug_follows_github() -> None:
    assert slug("The SDKs' own retries") == "the-sdks-own-retries"
    assert slug("Admin port and `/status`") == "admin-port-and-status"
    assert slug("Retries: the SDK's and the sidecar's") == "retries-the-sdks-and-the-sidecars"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_lands(doc: Path) -> None:
    dead = []
    for target in LINK_RE.findall(prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            dead.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not dead, dead


def test_every_repository_path_the_readme_names_exists() -> None:
    missing = [
        p
        for p in set(PATH_RE.findall(prose(README.read_text())))
        if not p.startswith("/") and not (ROOT / p.rstrip("/")).exists()
    ]
    assert not missing, sorted(missing)


def test_the_contents_list_links_every_section() -> None:
    text = prose(README.read_text())
    sections = re.findall(r"^## (.+)$", text, re.MULTILINE)
    contents = text[text.index("**Contents**") : text.index("\n## ")]
    linked = set(re.findall(r"\]\(#([\w-]+)\)", contents))
    assert len(sections) >= 7, sections
    assert {slug(s) for s in sections} <= linked, sections
    assert linked <= anchors(README), linked - anchors(README)

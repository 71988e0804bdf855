"""The code blocks of ``README.md``, as the README's tests read them.

A TOML config in the README is either a fenced ```` ```toml ```` block (indented
ones inside list items included) or a shell here-document ``cat > NAME <<'TOML'``
inside a ```` ```sh ```` block. The HTML comment on the line right before a
fence (blank lines between allowed) marks it, and is invisible on GitHub:

- ``<!-- toml: fragment -->``: a part of a config (a ``[fleet]`` table alone); it
  is checked merged into the smallest whole config (:data:`FRAGMENT_BASE`);
- ``<!-- toml: NAME -->``: a whole config the README's commands call ``NAME``
  (``my.toml``); the tests find a recipe's config by it;
- no comment: a whole config.

A here-document is named by its ``cat > NAME``.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

FENCE_RE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARK_RE = re.compile(r"^\s*<!--\s*toml:\s*(?P<mark>[\w.-]+)\s*-->\s*$")
HEREDOC_RE = re.compile(r"cat > (?P<name>[\w.-]+) <<'TOML'\n(?P<body>.*?)\nTOML\n", re.DOTALL)
FRAGMENT = "fragment"

FRAGMENT_BASE = """\
[upstreams.base]
base_url = "http://127.0.0.1:8001"

[[routes]]
name = "base"
path_prefix = "/"
candidates = [{ upstream = "base" }]
"""
"""The smallest whole config; a fragment is checked merged into it."""


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, the line of its opening fence (1-based),
    its text (dedented) and the ``<!-- toml: ... -->`` mark before it, if any."""

    lang: str
    line: int
    text: str
    mark: str | None


@dataclass(frozen=True)
class TomlConfig:
    """One TOML config of the README: ``where`` is ``README.md:LINE``; ``name`` the
    mark or the here-document's file name (``None``: unnamed); ``fragment`` when
    marked so."""

    where: str
    text: str
    name: str | None
    fragment: bool


def blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, in order.

    :raises ValueError: a fence is never closed.
    """
    lines = text.splitlines()
    out: list[Block] = []
    n = 0
    while n < len(lines):
        opening = FENCE_RE.match(lines[n])
        if not opening:
            n += 1
            continue
        mark = _mark_before(lines, n)
        body: list[str] = []
        end = n + 1
        while end < len(lines) and not FENCE_RE.match(lines[end]):
            body.append(lines[end])
            end += 1
        if end == len(lines):
            raise ValueError(f"README.md:{n + 1}: fence never closed")
        text_ = textwrap.dedent("\n".join(body)) + "\n"
        out.append(Block(opening.group("lang"), n + 1, text_, mark))
        n = end + 1
    return out


def _mark_before(lines: list[str], fence: int) -> str | None:
    n = fence - 1
    while n >= 0 and not lines[n].strip():
        n -= 1
    found = MARK_RE.match(lines[n]) if n >= 0 else None
    return found.group("mark") if found else None


def toml_configs(text: str) -> list[TomlConfig]:
    """Every TOML config of a README text: ``toml`` blocks and ``sh`` here-documents."""
    out: list[TomlConfig] = []
    for b in blocks(text):
        where = f"README.md:{b.line}"
        if b.lang == "toml":
            fragment = b.mark == FRAGMENT
            out.append(TomlConfig(where, b.text, None if fragment else b.mark, fragment))
        elif b.lang == "sh":
            for doc in HEREDOC_RE.finditer(b.text):
                out.append(TomlConfig(where, doc.group("body") + "\n", doc.group("name"), False))
    return out


def readme_configs() -> list[TomlConfig]:
    """:func:`toml_configs` of the repository's ``README.md``."""
    return toml_configs(README.read_text(encoding="utf-8"))


def named(name: str) -> TomlConfig:
    """The README's config called ``name``.

    :raises LookupError: none or several.
    """
    found = [c for c in readme_configs() if c.name == name]
    if len(found) != 1:
        raise LookupError(f"README.md has {len(found)} TOML configs named {name!r}")
    return found[0]

"""Fenced code blocks of a Markdown page, with the `not-run` marker before each.

A block that cannot run in the test suite says so in an HTML comment on the last
non-blank line before its fence, with the reason::

    <!-- not-run: needs a broker on the LAN -->
    ```python
    with fedring.connect("mqtt://HOST:1883", ...) as group: ...
    ```

Fences are CommonMark's: three or more backticks or tildes, possibly indented
(inside a list item); the block ends at a fence of the same character at least as
long. The info string's first word is the language.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PYTHON = frozenset({"python", "py", "python3"})
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
NOT_RUN = re.compile(r"^<!--\s*not-run:(?P<reason>.*?)-->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the marker's reason ("" for a marker without one), None: run it

    @property
    def python(self) -> bool:
        return self.lang in PYTHON


def blocks(path: Path) -> Iterator[Block]:
    """Every fenced block of the page at `path`, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None or (m["fence"][0] == "`" and "`" in m["info"]):
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        end = i + 1
        while end < len(lines) and not _closes(lines[end], fence):
            end += 1
        # a fence indented inside a list item indents its body as much: strip that much
        body = "\n".join(line[min(indent, len(line) - len(line.lstrip())) :]
                         for line in lines[i + 1 : end])  # fmt: skip
        words = m["info"].split()
        yield Block(path, i + 1, words[0].lower() if words else "",
                    textwrap.dedent(body) + "\n", _marker(lines, i))  # fmt: skip
        i = end + 1


def _closes(line: str, fence: str) -> bool:
    s = line.strip()
    return len(s) >= len(fence) and set(s) == {fence[0]}


def _marker(lines: list[str], fence_line: int) -> str | None:
    """The reason of a `not-run` comment on the last non-blank line before the fence."""
    for line in reversed(lines[:fence_line]):
        if line.strip():
            m = NOT_RUN.match(line.strip())
            return None if m is None else m["reason"].strip()
    return None

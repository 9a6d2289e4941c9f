"""The docs teach what runs: every Python block of README.md and docs/ is executed.

Each fenced ``python`` block runs as a script of its own in a fresh interpreter
(`tests/markdown_blocks.py` finds them), so a block cannot lean on another's
names, and one that starts threads or sets torch's thread count cannot leak into
other tests. A block that cannot run here carries ``<!-- not-run: REASON -->`` on
the line before its fence, and the reason is required. Our own collector rather
than a plugin (pytest-markdown-docs runs blocks inside the pytest process, with
the leaks above): it is one parametrized test over (page, block).

The site itself is built by `make lint` (``mkdocs build --strict``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.markdown_blocks import Block, blocks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.python]
TIMEOUT_S = 120  # a block trains a few dozen small steps: seconds, not minutes


def _id(b: Block) -> str:
    return f"{b.path.relative_to(ROOT)}:{b.line}"


@pytest.mark.parametrize("block", [b for b in PYTHON if b.not_run is None], ids=_id)
def test_the_python_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, f"{_id(block)} failed:\n{done.stdout}\n{done.stderr}"


def test_every_block_that_does_not_run_says_why() -> None:
    unexplained = [_id(b) for b in ALL if b.not_run == ""]
    assert not unexplained, f"`<!-- not-run: REASON -->` without a reason: {unexplained}"
    assert [b for b in PYTHON if b.not_run is None], "the collector found no block to run"


def test_the_collector_reads_fences_markers_and_list_indents(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n```python\nif True:\n    x = 1\n```\n\n<!-- not-run: needs a broker -->\n"
        "```py\nconnect()\n```\n\n- item\n\n  ```python\n  y = 2\n  ```\n\n````sh\n```\n````\n"
    )
    found = list(blocks(page))
    assert [(b.lang, b.code, b.not_run) for b in found] == [
        ("python", "if True:\n    x = 1\n", None),
        ("py", "connect()\n", "needs a broker"),
        ("python", "y = 2\n", None),
        ("sh", "```\n", None),
    ]


def test_the_readme_is_short_and_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    commands = [line.split("#")[0].strip() for line in readme.splitlines()]
    assert "make demo" in commands and "make test" in commands
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "mkdocs build --strict" in makefile.split("\ntest:")[0]  # `make test` lints the docs


def test_the_api_reference_covers_the_public_api() -> None:
    api = (ROOT / "docs" / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^::: fedring\.[\w.]*?\.(\w+)$", api, re.M))
    wanted = {"local_group", "connect", "Group", "Reducer", "ReducerSettings",
              "DistributedOptimizer", "ShardSampler", "LinearScaling", "Task",
              "group_topk_hook", "GroupTopKState"}  # fmt: skip
    assert wanted <= documented, wanted - documented

"""Files a run leaves behind, written so that a reader never sees half of one."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a file


def jsonl(rows: Sequence[Mapping[str, Any]]) -> str:
    """One JSON object per line (metrics.jsonl)."""
    return "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)

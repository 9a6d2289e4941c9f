"""What `--out DIR` writes: metrics.jsonl (one row per round), config.toml, summary.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedring.config import JobSpec


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a file


def write_outputs(out: Path, spec: JobSpec, summary: dict[str, Any]) -> dict[str, str]:
    """Write the run's files under `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "metrics": out / "metrics.jsonl",
        "config": out / "config.toml",
        "summary": out / "summary.json",
    }
    rows = "".join(json.dumps(row, sort_keys=True) + "\n" for row in summary["rows"])
    _atomic_write(paths["metrics"], rows)
    config = "".join(f"{k} = {_toml_value(v)}\n" for k, v in spec.resolved().items())
    _atomic_write(
        paths["config"], "# resolved job: `fedring simulate --config` reads it back\n" + config
    )
    brief = {k: v for k, v in summary.items() if k != "rows"}
    _atomic_write(paths["summary"], json.dumps(brief, indent=2, sort_keys=True) + "\n")
    return {k: str(v) for k, v in paths.items()}

"""What `fedring simulate --out DIR` writes besides the report: metrics.jsonl (one row
per round), config.toml, summary.json; and the dense twin `--with-dense` runs beside.

``report.md`` and its plots come from `fedring.report`, as for the coordinator.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedring.config import JobSpec
from fedring.report import atomic_write, jsonl


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def write_outputs(out: Path, spec: JobSpec, summary: dict[str, Any]) -> dict[str, str]:
    """Write the run's files under `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "metrics": out / "metrics.jsonl",
        "config": out / "config.toml",
        "summary": out / "summary.json",
    }
    atomic_write(paths["metrics"], jsonl(summary["rows"]))
    config = "".join(f"{k} = {_toml_value(v)}\n" for k, v in spec.resolved().items())
    atomic_write(
        paths["config"], "# resolved job: `fedring simulate --config` reads it back\n" + config
    )
    brief = {k: v for k, v in summary.items() if k != "rows"}
    atomic_write(paths["summary"], json.dumps(brief, indent=2, sort_keys=True) + "\n")
    return {k: str(v) for k, v in paths.items()}


BASELINE_KEYS = (
    "final_accuracy", "rounds", "bytes_sent_per_agent", "wall_seconds", "setup_seconds",
    "sim_seconds", "sim_seconds_to_target", "sim_rounds_to_target", "fleet",
)  # fmt: skip


def dense_twin(spec: JobSpec) -> JobSpec:
    """The same job as a dense fp32 ring. A learning rate that was the automatic choice
    for group-top-k (0.1, plain EF-SGD) becomes the dense ring's automatic one (0.025)."""
    auto = spec.replace(lr=0.0).lr == spec.lr
    return spec.replace(compression="none", lr=0.0 if auto else spec.lr)

"""What a finished coordinator run leaves in its `--out` folder, beside checkpoint.pt.

- ``model.onnx``: the final checkpoint exported and checked (`onnx_export`); a failed
  check is recorded in the summary (``onnx.error``), never raised, so the other files
  are still written;
- ``metrics.jsonl``: the ring head's row of every round, appended as each arrives
  (so a crashed coordinator keeps its history and ``--resume`` carries it on: rows
  past the checkpoint's round are dropped and redone), rewritten whole at the end;
- ``report.md`` and its plots (`fedring.report`);
- ``summary.json``, written last and atomically.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.extras import MissingExtra, require
from fedring.report import atomic_write, jsonl, write_report_for

log = logging.getLogger(__name__)
METRICS = "metrics.jsonl"


def export(out: Path, counters: Counters) -> dict[str, Any]:
    """Export ``out/checkpoint.pt`` to ``out/model.onnx``; the report, or its error."""

    def run() -> dict[str, Any]:
        from fedring.coordinator.onnx_export import export_from_checkpoint

        return export_from_checkpoint(out, out / "model.onnx")

    return guarded_export(run, counters)


def guarded_export(run: Callable[[], dict[str, Any]], counters: Counters) -> dict[str, Any]:
    """`run` an ONNX export: its report, or why not (counted and logged). A lean install
    has no onnx: the job still ends, with the reason in the summary."""
    try:
        for module in ("onnx", "onnxruntime", "onnxscript"):
            require(module, "the ONNX export")
    except MissingExtra as exc:
        counters.add("onnx_export_skipped")
        log.warning("%s", exc)
        return {"error": str(exc)}
    from fedring.coordinator.onnx_export import ExportError

    try:
        return run()
    except (ExportError, ValueError) as exc:
        counters.add("onnx_export_failed")
        log.error("ONNX export failed: %s", exc)
        return {"error": str(exc)}


def append_row(out: Path, row: Mapping[str, Any]) -> None:
    """Add one round's row to ``out/metrics.jsonl`` now (flushed before returning)."""
    line = json.dumps(row, sort_keys=True) + "\n"
    try:
        _append(out / METRICS, line)
    except FileNotFoundError:  # the first row: one mkdir, not one a round
        out.mkdir(parents=True, exist_ok=True)
        _append(out / METRICS, line)


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line)


def load_rows(out: Path, *, up_to: int, keep: bool) -> dict[int, dict[str, Any]]:
    """The rows a resumed job already has (rounds 1..`up_to`), by round; a new job
    (`keep` false) starts ``metrics.jsonl`` afresh. Unreadable lines are skipped."""
    path = out / METRICS
    if not keep or not path.exists():
        path.unlink(missing_ok=True)
        return {}
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            log.warning("%s: skipped an unreadable line", path)
            continue
        if isinstance(row, dict) and type(row.get("round")) is int and row["round"] <= up_to:
            rows[row["round"]] = row
    atomic_write(path, jsonl([rows[r] for r in sorted(rows)]))  # the redone rounds go
    return rows


def write(
    out: Path, spec: JobSpec, summary: dict[str, Any], rows: Sequence[Mapping[str, Any]]
) -> dict[str, str]:
    """metrics.jsonl, report.md with its plots, then summary.json; their paths."""
    metrics = out / METRICS
    atomic_write(metrics, jsonl(rows))
    command = f"fedring coordinator run (job {summary['job']})"
    paths = write_report_for(out, spec, {**summary, "rows": list(rows)}, command=command)
    summary["outputs"] = {"metrics": str(metrics), "summary": str(out / "summary.json"), **paths}
    atomic_write(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary["outputs"]

"""What a finished coordinator run leaves in its `--out` folder, beside checkpoint.pt.

- ``model.onnx``: the final checkpoint exported and checked (`onnx_export`); a failed
  check is recorded in the summary (``onnx.error``), never raised, so the other files
  are still written;
- ``metrics.jsonl``: the ring head's row of every round (after ``--resume``, from
  there on);
- ``report.md`` and its plots (`fedring.report`);
- ``summary.json``, written last and atomically.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.report import atomic_write, jsonl, write_report_for

log = logging.getLogger(__name__)


def export(out: Path, counters: Counters) -> dict[str, Any]:
    """Export ``out/checkpoint.pt`` to ``out/model.onnx``; the report, or its error."""
    from fedring.coordinator.onnx_export import ExportError, export_from_checkpoint

    try:
        return export_from_checkpoint(out, out / "model.onnx")
    except (ExportError, ValueError) as exc:
        counters.add("onnx_export_failed")
        log.error("ONNX export failed: %s", exc)
        return {"error": str(exc)}


def write(
    out: Path, spec: JobSpec, summary: dict[str, Any], rows: Sequence[Mapping[str, Any]]
) -> dict[str, str]:
    """metrics.jsonl, report.md with its plots, then summary.json; their paths."""
    metrics = out / "metrics.jsonl"
    atomic_write(metrics, jsonl(rows))
    command = f"fedring coordinator run (job {summary['job']})"
    paths = write_report_for(out, spec, {**summary, "rows": list(rows)}, command=command)
    summary["outputs"] = {"metrics": str(metrics), "summary": str(out / "summary.json"), **paths}
    atomic_write(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary["outputs"]

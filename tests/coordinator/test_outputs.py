"""What a finished coordinator run writes: metrics.jsonl, report.md with plots, summary.json."""

from __future__ import annotations

import json
from pathlib import Path

from fedring.config import JobSpec
from fedring.coordinator import outputs


def test_write_leaves_metrics_report_and_summary_last(tmp_path: Path) -> None:
    spec = JobSpec.from_mapping({"agents": 2, "rounds": 3})
    rows = [{"round": r, "loss": 1.0 / r, "bytes_sent": 100 * r} for r in range(1, 4)]
    summary = {"job": "j1", "final_accuracy": 0.5, "rounds": 3}
    paths = outputs.write(tmp_path, spec, summary, rows)
    assert [
        json.loads(line)["round"] for line in Path(paths["metrics"]).read_text().splitlines()
    ] == [1, 2, 3]
    assert "fedring coordinator run (job j1)" in Path(paths["report"]).read_text()
    assert Path(paths["bytes_per_round"]).exists()
    saved = json.loads(Path(paths["summary"]).read_text())
    assert saved["outputs"] == paths and "rows" not in saved
    assert not list(tmp_path.glob("*.tmp"))

"""`fedring bench quality` on a tiny regime: cells land in quality.json, a second run
skips them, and the table and the plot are made from all of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedring.bench import quality, quality_report

TINY = quality.Regime("tiny", "local SGD, 1 step, 6 rounds, 2 agents", {
    "agents": 2, "dataset": "digits", "sync": "local", "local_steps": 1, "rounds": 6,
    "eval_every": 6}, {"auto": {}, "1%": quality.FIXED})  # fmt: skip


def test_cells_accumulate_and_the_table_says_which_goal_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(quality.REGIMES, "tiny", TINY)
    lines: list[str] = []
    first = quality.run(tmp_path, ["tiny"], seeds=1, say=lines.append)
    assert [r["method"] for r in first.rows] == ["dense", "auto", "1%"] and len(lines) == 3
    saved = json.loads((tmp_path / "quality.json").read_text())["rows"]
    assert saved == first.rows and saved[1]["density"] == pytest.approx(0.3704)
    again = quality.run(tmp_path, ["tiny"], seeds=1, say=lines.append)
    assert len(again.rows) == 3 and len(lines) == 3  # nothing ran twice
    quality_report.write(again.rows, tmp_path)
    table = (tmp_path / "quality.md").read_text()
    dense, auto = (next(r for r in saved if r["method"] == m) for m in ("dense", "auto"))
    saving = dense["uplink_bytes"] / auto["uplink_bytes"]
    assert f"| {saving:.1f} |" in table and (tmp_path / "quality.png").stat().st_size > 10_000
    [cell] = [c for c in quality_report.cells(again.rows, "main") if c.method == "auto"]
    gap = 100 * (auto["accuracy"] - dense["accuracy"])
    assert cell.gap_pp == pytest.approx(gap) and cell.saving == pytest.approx(saving)
    held = (gap >= -1.0, saving >= 10.0)
    assert cell.goal == {(True, True): "both", (True, False): "1 pp only",
                         (False, True): "10x only", (False, False): "neither"}[held]  # fmt: skip


def test_the_frontier_densities_are_sized_for_their_savings() -> None:
    assert [quality.frontier_density(s) for s in quality.FRONTIER] == [
        0.2222, 0.1111, 0.0556, 0.0222,
    ]  # fmt: skip

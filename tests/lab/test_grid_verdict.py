"""Issue 29's verdict on a grid (`fedring.bench.lab_grid_verdict`): auto-codec against
the best fixed fedring setting and the fastest peer, the 5x bar where the dense round
is mostly communication, and the noise read from runs of the same plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedring.bench.lab_grid import Cell, parse_model, run_rows
from fedring.bench.lab_grid_verdict import comm_share, noise, verdict

MODEL = "digits/mlp"


def run(method: str, seconds: float | None, bw: float, **extra: Any) -> dict[str, Any]:
    return {"agents": 4, "bandwidth_mbps": bw, "delay_ms": 0.0, "model": MODEL,
            "method": method, "seconds_to_target": seconds, "cap_s": 60.0,
            "best_accuracy": 0.9, "error": "", "curve": [[1.0, 0.5]], **extra}  # fmt: skip


def rows(out: Path, bw: float, method: str, comm_s: float, step_s: float) -> None:
    slug = Cell(4, bw, 0.0, parse_model(MODEL)).slug
    where = out / "n4" / slug / method
    where.mkdir(parents=True)
    lines = [{"round": r, "comm_s": comm_s, "step_s": step_s, "compute_s": step_s - comm_s}
             for r in range(1, 8)]  # fmt: skip
    (where / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_the_verdict_holds_a_cell_auto_wins_and_refuses_one_it_loses(tmp_path: Path) -> None:
    doc = {"runs": [
        # 50 Mbit/s: the CPU's cell; auto-codec chose the dense ring and matched it
        run("fanout", 5.0, 50.0), run("dense", 4.0, 50.0), run("ddp", 4.1, 50.0),
        run("auto-codec", 4.2, 50.0, collective="dense ring"),
        # 1 Mbit/s: the link's cell; group-top-k fanout 10x the dense ring, 3x DDP
        run("fanout", 2.0, 1.0), run("dense", 20.0, 1.0), run("ddp", 6.0, 1.0),
        run("auto-codec", 2.0, 1.0, collective="fanout"),
    ]}  # fmt: skip
    rows(tmp_path, 1.0, "dense", comm_s=0.9, step_s=1.0)
    rows(tmp_path, 50.0, "dense", comm_s=0.2, step_s=1.0)
    # two pairs of the same plan: 4.2 against 4.0 and 2.0 against 2.0
    assert sorted(round(x, 3) for x in noise(doc)) == [0.0, 0.05]
    text = verdict(doc, lambda r: run_rows(tmp_path, r))
    [cpu_cell] = [line for line in text.splitlines() if "| 50 |" in line]
    [link_cell] = [line for line in text.splitlines() if "| 1 |" in line]
    # 4.2 / 4.0 = 1.05: at the fixed bar, but over the fastest peer beyond the noise (1.025)
    assert "1.05 (dense)" in cpu_cell and cpu_cell.endswith("not held |")
    # the link's cell: faster than all, but only 3x DDP where the dense round is 90% comm
    assert "0.90" in link_cell and "3.0" in link_cell and link_cell.endswith("not held |")
    assert "Held in 0 of 2 cells judged" in text


def test_a_cell_beaten_5x_everywhere_is_held_and_comm_share_falls_back(tmp_path: Path) -> None:
    doc = {"runs": [run("ring", 2.0, 1.0, round_ms=None), run("dense", 30.0, 1.0, round_ms=100.0),
                    run("ddp", 12.0, 1.0), run("flower", None, 1.0),
                    run("auto-codec", 2.0, 1.0, collective="ring")]}  # fmt: skip
    # no dense rows: 1 - auto-codec's compute (5 ms) / the dense round (100 ms)
    rows(tmp_path, 1.0, "auto-codec", comm_s=0.005, step_s=0.010)
    runs = {r["method"]: r for r in doc["runs"]}
    assert abs(comm_share(lambda r: run_rows(tmp_path, r), runs) - 0.95) < 1e-9  # type: ignore[operator]
    text = verdict(doc, lambda r: run_rows(tmp_path, r))
    assert text.splitlines()[2].endswith("| ≥ 6.0 | held |")
    assert "Held in 1 of 1 cells judged" in text


def test_a_cell_with_nothing_to_compare_is_not_judged(tmp_path: Path) -> None:
    """auto-codec alone, or beside a peer that failed before measuring anything: no
    verdict (not 'held' against runs that never happened)."""
    doc = {"runs": [run("auto-codec", 2.0, 1.0, collective="ring"),
                    run("ddp", None, 1.0, error="BaselineError: timed out", curve=[])]}  # fmt: skip
    text = verdict(doc, lambda r: run_rows(tmp_path, r))
    assert text.splitlines()[2].endswith("| not judged |")
    assert "Held in 0 of 0 cells judged" in text
    # a truncated metrics line (a run killed at the cap) is skipped, not fatal
    rows(tmp_path, 1.0, "auto-codec", comm_s=0.005, step_s=0.010)
    slug = Cell(4, 1.0, 0.0, parse_model(MODEL)).slug
    with (tmp_path / "n4" / slug / "auto-codec" / "metrics.jsonl").open("a") as f:
        f.write('{"round": 8, "comm')
    runs = {"dense": run("dense", 30.0, 1.0, round_ms=100.0), "auto-codec": doc["runs"][0]}
    assert abs(comm_share(lambda r: run_rows(tmp_path, r), runs) - 0.95) < 1e-9  # type: ignore[operator]


def test_a_cell_no_method_reached_is_not_judged(tmp_path: Path) -> None:
    doc = {"runs": [run("auto-codec", None, 1.0, collective="ring"), run("ring", None, 1.0),
                    run("ddp", None, 1.0)]}  # fmt: skip
    text = verdict(doc, lambda r: run_rows(tmp_path, r))
    assert text.splitlines()[2].endswith("| none reached |")
    assert "Held in 0 of 0 cells judged" in text

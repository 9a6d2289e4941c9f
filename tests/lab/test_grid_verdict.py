"""Issue 29's verdict on a grid (`fedring.bench.lab_grid_verdict`): auto-codec against
the best fixed fedring setting and the fastest peer, the 5x bar where the dense round
is mostly communication, and the noise read from runs of the same plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedring.bench.lab_grid import Cell, keep_digests, parse_model, run_rows
from fedring.bench.lab_grid_verdict import comm_share, compute_floor, noise, verdict

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


def trained(
    out: Path, bw: float, method: str, hit: int, last: int, compute_s: float, comm_s: float = 0.0
) -> None:
    """Rounds 1..`last` of `compute_s` each (the first two, the warm-up, 10x slower),
    accuracy every 5 rounds: 0.5, then 0.95 (over the 0.9 target) from round `hit`."""
    slug = Cell(4, bw, 0.0, parse_model(MODEL)).slug
    where = out / "n4" / slug / method
    where.mkdir(parents=True)
    lines = [{"round": r, "compute_s": compute_s * (10 if r <= 2 else 1), "comm_s": comm_s,
              "step_s": compute_s + comm_s, "wall_s": r * 0.1,
              **({"accuracy": 0.95 if r >= hit else 0.5} if r % 5 == 0 else {})}
             for r in range(1, last + 1)]  # fmt: skip
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
    # no run told its rounds to target (no accuracy rows, no target): no floor
    assert text.splitlines()[2].endswith("| ≥ 6.0 | – | – (no floor) | held |")
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


def _floor_cell(out: Path, bw: float, dense_s: float | None = 9.0) -> list[dict[str, Any]]:
    """A cell where the dense round is 90% communication: the dense ring reached the 0.9
    target at round 20 (and ran on to 25; with `dense_s` None, never), the ring at 30,
    auto-codec at 40 with 2 ms of compute a round; the floor is 20 (or 30) x 2 ms."""
    trained(out, bw, "dense", hit=20 if dense_s else 99, last=25, compute_s=0.01, comm_s=0.09)
    trained(out, bw, "ring", hit=30, last=30, compute_s=0.004)
    trained(out, bw, "auto-codec", hit=40, last=40, compute_s=0.002)
    return [run("dense", dense_s, bw, target=0.9), run("ring", 1.2, bw, target=0.9),
            run("auto-codec", 1.0, bw, target=0.9, collective="ring")]  # fmt: skip


def test_the_compute_floor_says_whether_5x_is_reachable_at_all(tmp_path: Path) -> None:
    doc = {"runs": [
        # 1 Mbit/s: DDP needs 3 s; 3 / 5 = 0.6 s >= the 0.04 s floor (15x room)
        *_floor_cell(tmp_path, 1.0), run("ddp", 3.0, 1.0), run("flower", None, 1.0),
        # 10 Mbit/s: DDP needs 0.16 s; 0.032 s < 0.04 s: no codec nor collective gets 5x
        *_floor_cell(tmp_path, 10.0), run("ddp", 0.16, 10.0),
    ]}  # fmt: skip
    runs = {r["method"]: r for r in doc["runs"] if r["bandwidth_mbps"] == 1.0}
    assert compute_floor(lambda r: run_rows(tmp_path, r), runs) == (20, 20 * 0.002, True)
    text = verdict(doc, lambda r: run_rows(tmp_path, r))
    [reached] = [line for line in text.splitlines() if "| 1 |" in line]
    [beyond] = [line for line in text.splitlines() if "| 10 |" in line]
    assert reached.endswith("| 0.040 (20 × 2.00 ms) | yes (15.0) | not held |")
    assert beyond.endswith("| 0.040 (20 × 2.00 ms) | no (0.8) | not held |")
    assert ("unreachable at the compute floor in 1 of the 2 cells where it applies "
            "(reachable in 1; the data cannot tell in 0)") in text  # fmt: skip


def test_the_compute_floor_says_dash_where_the_data_cannot_tell(tmp_path: Path) -> None:
    rows_of = lambda r: run_rows(tmp_path, r)  # noqa: E731
    # every peer (the dense ring too) capped at 60 s: 60 / 5 = 12 s; the ring's 30 rounds
    capped = {"runs": [*_floor_cell(tmp_path, 1.0, dense_s=None), run("ddp", None, 1.0)]}
    assert verdict(capped, rows_of).splitlines()[2].endswith(
        "| 0.060 (30 × 2.00 ms) | yes (≥ 200.0) | held |")  # fmt: skip
    # ...but with 0.5 s of compute a round, a 15 s floor: the peers' true times could be either
    slow = lambda r: [{**row, "compute_s": 0.5} for row in rows_of(r)]  # noqa: E731
    text = verdict(capped, slow)
    assert text.splitlines()[2].endswith(
        "| 15.000 (30 × 500.00 ms) | – (peers capped at 60 s) | held |"
    )
    # auto-codec's rows without compute_s: no floor, counted apart
    bare = lambda r: [{k: v for k, v in row.items() if k != "compute_s"} for row in rows_of(r)]  # noqa: E731
    text = verdict(capped, bare)
    assert text.splitlines()[2].endswith("| – | – (no floor) | held |")
    assert (
        "in 0 of the 1 cells where it applies (reachable in 0; the data cannot tell in 1)" in text
    )
    # a fixed run that reached the target and kept no rows counts its rounds (the job stops
    # at the target); one whose curve does not end at the target leaves the floor a bound
    hub = run("hub", 0.8, 10.0, target=0.9, rounds=10, curve=[[0.4, 0.5], [0.8, 0.95]])
    doc = {"runs": [*_floor_cell(tmp_path, 10.0), hub, run("ddp", 0.3, 10.0)]}
    assert "| 0.020 (10 × 2.00 ms) | yes (3.0) |" in verdict(doc, rows_of)
    hub["curve"] = [[0.4, 0.5]]
    assert "| ≤ 0.040 (20 × 2.00 ms) | yes (1.5) |" in verdict(doc, rows_of)
    doc["runs"][-1]["seconds_to_target"] = 0.16  # 0.032 s: under the floor read so far
    assert "| – (a run's rounds unknown) | not held |" in verdict(doc, rows_of)


def test_a_grid_moved_without_its_run_folders_keeps_its_verdict(tmp_path: Path) -> None:
    """`write` keeps what the verdict reads of each run's rows in grid.json
    (`keep_digests`): the table made from that file alone, in another folder, is the
    same; without the digests the floor and the comm share are gone."""
    doc = {"runs": [*_floor_cell(tmp_path, 1.0), run("ddp", 3.0, 1.0)]}
    made = verdict(doc, lambda r: run_rows(tmp_path, r))
    assert "| 0.90 |" in made and "| 0.040 (20 × 2.00 ms) | yes (15.0) |" in made
    keep_digests(doc, tmp_path)
    kept = json.loads(json.dumps(doc))  # as grid.json holds it
    moved = tmp_path / "moved"
    moved.mkdir()
    assert {r["method"]: "rows_digest" in r for r in kept["runs"]} == {
        "dense": True, "ring": True, "auto-codec": True, "ddp": False}
    assert verdict(kept, lambda r: run_rows(moved, r)) == made
    for r in kept["runs"]:
        r.pop("rows_digest", None)
    bare = verdict(kept, lambda r: run_rows(moved, r)).splitlines()[2]
    # no comm share, no floor: the 5x bar (3x DDP here) would no longer be seen to apply
    assert made.splitlines()[2].endswith("| not held |")
    assert bare.endswith("| – | 3.0 | – | n/a | held |")


def test_a_cells_recovered_figures_serve_only_while_none_of_its_runs_has_rows(
    tmp_path: Path,
) -> None:
    """Cells run before the digests carry the figures their report showed (``recovered``)."""
    saved = {"dense_comm": 0.9, "floor": [20, 0.04, True]}
    doc = {"runs": [run("dense", 9.0, 1.0, target=0.9), run("ring", 1.2, 1.0, target=0.9),
                    run("auto-codec", 1.0, 1.0, target=0.9, collective="ring"),
                    run("ddp", 3.0, 1.0)], "recovered": {"4|1|0|digits/mlp": saved}}  # fmt: skip
    line = verdict(doc, lambda r: run_rows(tmp_path, r)).splitlines()[2]
    assert "| 0.90 |" in line and line.endswith("| 0.040 (20 × 2.00 ms) | yes (15.0) | not held |")
    trained(tmp_path, 1.0, "ring", hit=30, last=30, compute_s=0.004)  # one run re-run: rows
    line = verdict(doc, lambda r: run_rows(tmp_path, r)).splitlines()[2]
    assert line.endswith("| – | 3.0 | – | n/a | held |")  # no dense rows, no auto-codec compute


def test_a_5x_bar_short_only_against_capped_peers_cannot_be_told(tmp_path: Path) -> None:
    """The dense round is 90% communication; auto-codec needs 13 s. Peers capped at 60 s
    bound its lead below only (60 / 13 = 4.6x, their true times are longer): the data
    cannot tell. One peer measured at 50 s (3.8x) settles it: not held."""
    rows(tmp_path, 1.0, "dense", comm_s=0.9, step_s=1.0)
    cell = [run("fanout", 13.5, 1.0), run("dense", None, 1.0), run("ddp", None, 1.0),
            run("auto-codec", 13.0, 1.0, collective="fanout")]  # fmt: skip
    text = verdict({"runs": cell}, lambda r: run_rows(tmp_path, r))
    line = text.splitlines()[2]
    assert "| ≥ 4.6 |" in line and line.endswith("| cannot tell (peers capped at 60 s) |")
    assert "Held in 0 of 1 cells judged; in 1 more, every other bar held" in text
    cell[2] = run("ddp", 50.0, 1.0)
    text = verdict({"runs": cell}, lambda r: run_rows(tmp_path, r))
    assert text.splitlines()[2].endswith("| not held |") and "more" not in text

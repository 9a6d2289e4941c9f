"""`fedring bench grid --resume DIR`: the runs in DIR/grid.json are kept, only the
missing (cell, method) pairs run, a cut-short invocation loses nothing, and every run
carries the agents' CPU share (CPU-bound ones marked in the table). The grid runs here
with a stand-in lab and stand-in methods: what is under test is the bookkeeping (the
real lab's one-cell grid is `test_lab_grid.py`'s)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from fedring.bench import lab_grid
from fedring.bench.lab_grid_cpu import CPU_BOUND, CpuShare
from fedring.bench.lab_grid_report import tables

MODEL = lab_grid.parse_model("digits/mlp")
AXES: dict[str, Any] = {"models": (MODEL,), "bandwidths": (1.0, 10.0), "delays": (0.0,),
                        "agents": (2,)}  # fmt: skip


class FakeLab:
    def __init__(self, workdir: Path) -> None:
        self.workdir, self.procs, self.agents_up = workdir, [], False
        self.shaped: list[float] = []

    def reshape(self, mbps: float) -> None:
        self.shaped.append(mbps)

    def set_delay(self, ms: float) -> None:
        assert not self.agents_up

    def start_agents(self) -> None:
        self.agents_up = True

    def stop_agents(self) -> None:
        self.agents_up = False


class Methods:
    """Stand-in runners: each call recorded; `fail` names runs that error out, `stop_after`
    interrupts the invocation (a ^C) once that many runs have ended."""

    def __init__(self, fail: tuple[str, ...] = (), stop_after: int | None = None) -> None:
        self.calls: list[tuple[float, str]] = []
        self.fail, self.stop_after = fail, stop_after

    @contextmanager
    def lab(self, n: int, bw: float, where: Path) -> Iterator[FakeLab]:
        where.mkdir(parents=True, exist_ok=True)
        yield FakeLab(where)

    def __call__(self, lab: FakeLab, cell: lab_grid.Cell, method: str) -> tuple[lab_grid.Run, bool]:
        if self.stop_after is not None and len(self.calls) >= self.stop_after:
            raise KeyboardInterrupt
        self.calls.append((cell.bandwidth_mbps, method))
        if method in self.fail:
            raise ValueError(f"{method} broke")
        run = lab_grid._run(cell, method, 5.0)
        lab_grid._score(run, [(1.0, 0.5), (cell.bandwidth_mbps, 0.96)])
        return run, False


def grid(out: Path, methods: tuple[str, ...], fake: Methods, resume: bool,
         **axes: Any) -> dict[str, Any]:  # fmt: skip
    a = {**AXES, **axes}
    return lab_grid.run(a["models"], a["bandwidths"], a["delays"], a["agents"], methods,
                        cap_s=5.0, out=out, resume=resume, open_lab=fake.lab,
                        measure=fake)  # fmt: skip


def stored(out: Path) -> list[tuple[float, str, str]]:
    doc = json.loads((out / "grid.json").read_text())
    return [(r["bandwidth_mbps"], r["method"], r["error"][:18]) for r in doc["runs"]]


def test_resume_runs_only_the_missing_cells_and_a_cut_short_grid_loses_nothing(
    tmp_path: Path,
) -> None:
    first = Methods(stop_after=3)  # two cells of two methods: ^C before the fourth run
    with pytest.raises(KeyboardInterrupt):
        grid(tmp_path, ("ring", "ddp"), first, resume=False)
    assert stored(tmp_path) == [(1.0, "ddp", ""), (1.0, "ring", ""), (10.0, "ddp", "")]
    again = Methods()
    doc = grid(tmp_path, ("ring", "ddp"), again, resume=True)
    assert again.calls == [(10.0, "ring")]  # only the run the ^C cut off
    assert len(doc["runs"]) == 4 and doc["invocations"] == 2 and doc["not_run"] == []
    table = (tmp_path / "grid.md").read_text()
    assert table.count("| 2 | digits/mlp (17,226) |") == 2 and "not run" not in table
    assert (tmp_path / "grid.png").stat().st_size > 10_000
    # a method added later runs in every cell, and only it
    more = Methods(fail=("auto-codec",))
    doc = grid(tmp_path, ("auto-codec",), more, resume=True)
    assert more.calls == [(1.0, "auto-codec"), (10.0, "auto-codec")]
    assert doc["methods"] == ["ring", "ddp", "auto-codec"]
    assert [r[2] for r in stored(tmp_path)[4:]] == ["ValueError: auto-c"] * 2
    # a failed run is not run again by an invocation that names other methods only
    other = Methods()
    grid(tmp_path, ("ddp",), other, resume=True)
    assert other.calls == [] and len(stored(tmp_path)) == 6
    # one that names every method (the CLI without --method) runs it again and replaces
    # it; the others stay
    last = Methods()
    doc = grid(tmp_path, ("ring", "ddp", "auto-codec"), last, resume=True, bandwidths=(10.0,))
    assert last.calls == [(1.0, "auto-codec"), (10.0, "auto-codec")]
    assert [r[2] for r in stored(tmp_path)] == [""] * 6 and doc["invocations"] == 5
    assert "auto (codec too)" in (tmp_path / "grid.md").read_text()


def test_resume_keeps_the_figures_recovered_for_cells_run_before_the_digests(
    tmp_path: Path,
) -> None:
    grid(tmp_path, ("ring",), Methods(), resume=False)
    doc = json.loads((tmp_path / "grid.json").read_text())
    doc["recovered"] = {"2|1|0|digits/mlp": {"dense_comm": 0.9, "floor": [20, 0.04, True]}}
    (tmp_path / "grid.json").write_text(json.dumps(doc))
    more = Methods()
    grid(tmp_path, ("ddp",), more, resume=True)
    assert len(more.calls) == 2
    kept = json.loads((tmp_path / "grid.json").read_text())
    assert kept["recovered"] == doc["recovered"] and kept["invocations"] == 2


def test_the_report_lists_every_cell_of_its_axes_that_no_sitting_ran(tmp_path: Path) -> None:
    # a sitting with its axes narrowed by hand (1 Mbit/s only), then the whole axes back
    # for the report: the cells no sitting named are listed, in run order
    grid(tmp_path, ("ring",), Methods(), resume=False, bandwidths=(1.0,))
    doc = json.loads((tmp_path / "grid.json").read_text())
    assert doc["not_run"] == []
    doc |= {"bandwidths_mbps": [1.0, 10.0], "delays_ms": [0.0, 20.0]}
    table = tables(doc)
    listed = table.split("Cells not run")[1].split("\n\n")[1].splitlines()
    assert listed == ["- N=2, 1 Mbit/s, 20 ms, digits/mlp", "- N=2, 10 Mbit/s, 0 ms, digits/mlp",
                      "- N=2, 10 Mbit/s, 20 ms, digits/mlp"]  # fmt: skip
    doc |= {"bandwidths_mbps": [1.0], "delays_ms": [0.0]}
    assert "Cells not run" not in tables(doc)


def test_without_resume_the_grid_starts_afresh(tmp_path: Path) -> None:
    grid(tmp_path, ("ring",), Methods(), resume=False)
    fresh = Methods()
    grid(tmp_path, ("ring",), fresh, resume=False)
    assert len(fresh.calls) == 2 and len(stored(tmp_path)) == 2


def test_resume_refuses_a_grid_of_another_cap_or_an_unreadable_one(tmp_path: Path) -> None:
    grid(tmp_path, ("ring",), Methods(), resume=False)
    with pytest.raises(lab_grid.ResumeError, match=r"cap_s=5\.0, this invocation 60\.0"):
        lab_grid.stored(tmp_path, 60.0, 0)
    (tmp_path / "grid.json").write_text('{"runs": [{"agents": 2}]}')
    with pytest.raises(lab_grid.ResumeError, match="cannot be read back"):
        lab_grid.stored(tmp_path, 5.0, 0)
    assert lab_grid.stored(tmp_path / "nothing-yet", 5.0, 0) is None


def test_the_agents_cpu_share_counts_their_process_trees_and_marks_cpu_bound(
    tmp_path: Path,
) -> None:
    busy = "import subprocess, sys, time\n" \
        "c = subprocess.Popen([sys.executable, '-c', 'import time\\nt = time.process_time()\\n" \
        "while time.process_time() - t < 0.4: pass'])\nc.wait()"  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", busy])
    try:
        with CpuShare(lambda: [proc.pid], period_s=0.05) as cpu:
            proc.wait(timeout=25)
    finally:
        proc.kill()
    # the child's 0.4 s of CPU, seen through its parent, less at most a period lost
    assert cpu.share > 0.0 and 0.0 < cpu.machine <= 1.0
    used = sum(s - cpu.base.get(p, 0.0) for p, s in cpu.seen.items())
    assert 0.3 <= used <= 1.5, used
    doc = grid(tmp_path, ("ring",), Methods(), resume=False)
    assert all(r["agents_cpu_share"] == 0.0 for r in doc["runs"])  # no agent processes
    doc["runs"][0]["agents_cpu_share"] = CPU_BOUND  # as an N = 8 cell on 2 cores measured
    table = tables(doc)
    assert "5.0‡" not in table and "1.0‡" in table and f"{CPU_BOUND:.2f} ‡" in table


def test_the_cli_refuses_to_resume_with_another_seed_before_building_a_lab(
    tmp_path: Path,
) -> None:
    from typer.testing import CliRunner

    from fedring.cli import app

    grid(tmp_path, ("ring",), Methods(), resume=False)
    result = CliRunner().invoke(app, ["bench", "grid", "--resume", str(tmp_path), "--seed", "3"])
    assert result.exit_code == 2
    assert "the stored grid has seed=0, this invocation 3" in " ".join(result.output.split())
    # --report-only re-makes the table from the stored runs, running nothing
    (tmp_path / "grid.md").unlink()
    result = CliRunner().invoke(app, ["bench", "grid", "--resume", str(tmp_path), "--report-only"])
    assert result.exit_code == 0 and "| 2 | digits/mlp (17,226) | 10 | 0 |" in result.output

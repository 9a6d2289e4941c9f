"""report.md and its plots: written from rows, dense beside compressed, readable sizes."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from fedring.cli import app
from fedring.report import write_report

runner = CliRunner()


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def _rows(n: int, per_round: int, error: float, with_clock: bool) -> list[dict]:
    rows = []
    for r in range(1, n + 1):
        row = {"round": r, "loss": 2.0 / r, "bytes_sent": per_round * r,
               "compression_error": error, "grad_norm": 1.0 / r}  # fmt: skip
        if r % 5 == 0:
            row["accuracy"] = 1 - 1 / r
        if with_clock:
            row["sim_seconds"] = 0.1 * r
        rows.append(row)
    return rows


def test_two_runs_share_every_plot_and_the_table(tmp_path: Path) -> None:
    runs = {"group-topk": _rows(30, 1_000, 0.9, True), "dense": _rows(30, 50_000, 0.0, True)}
    summaries = {"group-topk": {"final_accuracy": 0.95, "sim_seconds": 3.0},
                 "dense": {"final_accuracy": 0.96, "sim_seconds": 9.5}}  # fmt: skip
    paths = write_report(tmp_path, runs, title="t", summaries=summaries, notes=["a note"])
    names = {"curves_rounds", "curves_sim_seconds", "bytes_per_round", "compression"}
    assert set(paths) == names | {"report"}
    text = (tmp_path / "report.md").read_text()
    for name in names:
        width, height = _png_size(Path(paths[name]))
        assert width >= 700 and height >= 400
        assert f"({name}.png)" in text
    assert "| | group-topk | dense |" in text and "| final accuracy | 0.9500 | 0.9600 |" in text
    assert "| simulated seconds | 3.0 | 9.5 |" in text and "- a note" in text
    assert "rounds to target" not in text  # no run has it: the line is left out


def test_plots_without_data_are_left_out(tmp_path: Path) -> None:
    rows = [{"round": r, "loss": 1.0 / r} for r in range(1, 11)]
    paths = write_report(tmp_path, {"run": rows})
    assert set(paths) == {"report", "curves_rounds"}
    assert not (tmp_path / "curves_sim_seconds.png").exists()


def test_importing_the_package_does_not_load_matplotlib() -> None:
    # `simulate` without --out, and the coordinator until its last round, never draw.
    code = "import sys, fedring.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_simulate_out_writes_report_plots_and_onnx_beside_dense(tmp_path: Path) -> None:
    args = ["simulate", "--agents", "2", "--rounds", "20", "--eval-every", "10", "--fleet",
            "rpi4:2", "--with-dense", "--density", "0.01", "--out", str(tmp_path),
            "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    s = json.loads(result.stdout)
    assert s["dense_baseline"]["rounds"] == 20 and s["dense_baseline"]["sim_seconds"] > 0
    for key in ("report", "curves_rounds", "curves_sim_seconds", "bytes_per_round"):
        assert Path(s["outputs"][key]).exists()
    text = (tmp_path / "report.md").read_text()
    assert "dense fp32 ring" in text and "group-topk 1.00%" in text and "model.onnx" in text
    assert s["onnx"]["parity_ok"] and (tmp_path / "model.onnx").exists()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["sim_seconds"] == s["sim_seconds"]

"""`fedring bench lab`: its arithmetic, and one small run of every kind of method in a lab."""

from __future__ import annotations

import json
from pathlib import Path

from fedring.bench import edge_lab
from fedring.bench.edge_lab import Row, Task, speedups, table, to_target
from tests.lab.labcheck import leftovers
from tests.lab.test_lab import pytestmark as lab_only


def _row(method: str, seconds: float | None) -> Row:
    return Row(method, "t", 0.9, seconds, 3 if seconds else None, 0.91, 10, 2e6, 1e6, 5.0)


def test_time_to_target_is_the_first_point_at_or_above_it() -> None:
    curve = [(1.0, 0.5, 5), (2.0, 0.9, 10), (3.0, 0.95, 15)]
    assert to_target(curve, 0.9) == (2.0, 10)
    assert to_target(curve, 0.99) == (None, None)


def test_speedups_are_over_fedrings_fastest_compressed_method() -> None:
    rows = [_row("fedring group-top-k 1% sync", 4.0), _row("fedring group-top-k local", 2.0),
            _row("fedring dense ring", 20.0), _row("Flower", None)]  # fmt: skip
    got = speedups(rows)["t"]
    assert got == {"fedring group-top-k 1% sync": 2.0, "fedring group-top-k local": 1.0,
                   "fedring dense ring": 10.0, "Flower": None}  # fmt: skip
    text = table({"rows": [r.__dict__ for r in rows], "speedups": {"t": got}})
    assert "| t | fedring dense ring | 20.0 | 3 | 10.0× | 0.9100 | 2.00 | 1.00 |" in text
    assert "not reached" in text


@lab_only
def test_one_small_bench_run_measures_every_kind_of_method(tmp_path: Path) -> None:
    task = Task("tiny", "digits", "mlp", 0.8, 150)
    methods = ("fedring group-top-k 1% sync", "fedring dense ring", "torch DDP gloo",
               "Flower FedAvg (SuperLink)")  # fmt: skip
    doc = edge_lab.run(2, 50.0, (task,), methods, 0, tmp_path, 300.0,
                       edge_lab.default_baselines())  # fmt: skip
    rows = {r["method"]: r for r in doc["rows"]}
    assert sorted(rows) == sorted(methods)
    for r in rows.values():
        assert r["seconds_to_target"] is not None and r["seconds_to_target"] > 0, r["method"]
        assert r["final_accuracy"] >= 0.8
        assert r["bytes_sent_per_agent"] > 10_000 and r["bytes_received_per_agent"] > 10_000
        times = [t for t, _ in r["curve"]]
        assert times == sorted(times)
    dense, sparse = rows["fedring dense ring"], rows["fedring group-top-k 1% sync"]
    assert dense["bytes_sent_per_agent"] > 2 * sparse["bytes_sent_per_agent"]
    assert Path(doc["plot"]).stat().st_size > 10_000
    assert json.loads((tmp_path / "edge_lab.json").read_text())["rows"]
    assert leftovers(tmp_path) == []


def test_unknown_task_is_refused_by_the_cli() -> None:
    from typer.testing import CliRunner

    from fedring.cli import app
    from fedring.lab import netns

    result = CliRunner().invoke(app, ["bench", "lab", "--task", "cifar"])
    assert result.exit_code == 2
    # as root the task is refused; elsewhere the lab itself is, before any task is read
    assert ("cifar" if netns.can_build() is None else "root") in result.output

"""`fedring simulate` with pipeline stages: the job fields, the flags, the summary."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedring.cli import app
from fedring.config import JobSpec, SpecError
from fedring.sim import pipeline as sim_pipeline
from fedring.sim.runner import simulate

runner = CliRunner()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pipeline_stages": 0}, "field 'pipeline_stages'=0 must be an integer in [1, 64]"),
        ({"pipeline_schedule": "zigzag"}, "field 'pipeline_schedule'='zigzag' must be one of"),
        ({"activation_dtype": "int8"}, "field 'activation_dtype'='int8' must be one of fp32"),
        ({"micro_batches": 0}, "field 'micro_batches'=0 must be an integer"),
        ({"pipeline_stages": 3, "agents": 4}, "field 'agents'=4 must be a multiple of "
         "pipeline_stages=3"),
        ({"pipeline_stages": 2, "micro_batches": 40}, "field 'micro_batches'=40 exceeds "
         "batch_size=32"),
        ({"pipeline_stages": 2, "sync": "local"}, "it needs sync='sync', not 'local'"),
        ({"pipeline_stages": 2, "topology": "star", "aggregation": "median"},
         "it needs topology='auto', not 'star'"),
    ],
)  # fmt: skip
def test_pipeline_fields_are_checked_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError) as info:
        JobSpec.from_mapping(fields)
    assert message in str(info.value)


def test_a_2_x_2_grid_trains_digits_and_reports_plan_bubble_bytes_throughput() -> None:
    spec = JobSpec(agents=4, pipeline_stages=2, model="mlp:64x64", rounds=40, eval_every=20,
                   micro_batches=4, pipeline_schedule="gpipe")  # fmt: skip
    r = simulate(spec)
    assert r["layout"] == "pipeline 2 stages x 2 replicas" and r["rounds"] == 40
    stages = r["plan"]["stages"]
    assert stages[0]["start"] == 0 and stages[-1]["end"] == 6
    assert stages[0]["end"] == stages[1]["start"]  # contiguous, every layer once
    assert "stage 1 on generic-x86_64" in r["plan_text"]
    assert r["identical_models"] and len(r["model_hashes"]) == 2  # replicas agree per stage
    assert 0.0 < r["bubble_fraction"] < 1.0
    assert r["pipeline_payload_bytes_per_agent"] > 0 and r["ring_payload_bytes_per_agent"] > 0
    assert r["throughput_samples_per_s"] > 0 and r["throughput_estimate_samples_per_s"] > 0
    assert len(r["rows"]) == 40 and r["rows"][-1]["accuracy"] == r["final_accuracy"]
    sent = [row["bytes_sent"] for row in r["rows"]]  # cumulative per agent, every step
    assert all(a < b for a, b in itertools.pairwise(sent)) and sent[-1] == r["bytes_sent_per_agent"]
    assert r["final_accuracy"] > 0.5  # digits, 40 steps of a 2 x 2 grid (chance: 0.1)
    assert r["counters"]["pp-act_sent"] == r["counters"]["pp-grad_sent"] == 40 * 4 * 2


def test_fp16_activations_halve_the_pipeline_bytes() -> None:
    base = JobSpec(agents=2, pipeline_stages=2, rounds=4, eval_every=4, compression="none")
    sent = [simulate(base.replace(activation_dtype=d))["pipeline_payload_bytes_per_agent"]
            for d in ("fp32", "fp16")]  # fmt: skip
    assert sent[0] == 2 * sent[1]


def test_a_counted_split_is_the_same_on_any_load_and_a_measured_one_is_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default split counts multiply-adds: a machine that suddenly times the first
    layers 1000x slower cuts the same way, so the same seed gives the same hash.
    ``pipeline_cost = "measured"`` follows the timings (and moves with them)."""
    base = JobSpec(agents=2, pipeline_stages=2, rounds=4, eval_every=4, model="mlp:64x64x64")
    first = simulate(base)
    measured = sim_pipeline.measure_layers
    monkeypatch.setattr(sim_pipeline, "measure_layers", lambda *a, **k: [
        dataclasses.replace(c, seconds=c.seconds * (1000 if i < 2 else 1))
        for i, c in enumerate(measured(*a, **k))
    ])  # fmt: skip
    loaded = simulate(base)
    assert loaded["plan"] == first["plan"] and loaded["model_hashes"] == first["model_hashes"]
    timed = simulate(base.replace(pipeline_cost="measured"))["plan"]["stages"]
    # timed: cut at the slow layers
    assert [st["start"] for st in timed] != [st["start"] for st in first["plan"]["stages"]]
    with pytest.raises(SpecError, match=r"'pipeline_cost'='timed'"):
        base.replace(pipeline_cost="timed")


def test_cli_runs_a_pipeline_with_flags_and_prints_the_summary() -> None:
    result = runner.invoke(app, [
        "simulate", "--agents", "3", "--pipeline-stages", "3", "--micro-batches", "2",
        "--pipeline-schedule", "1f1b", "--rounds", "6", "--eval-every", "3", "--json",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["layout"] == "pipeline 3 stages x 1 replicas" and len(r["plan"]["stages"]) == 3
    assert r["ring_payload_bytes_per_agent"] == 0  # one replica per stage: no stage rings


def test_cli_refuses_a_bad_pipeline_flag_naming_it() -> None:
    result = runner.invoke(app, ["simulate", "--agents", "4", "--pipeline-stages", "3"])
    assert result.exit_code == 2
    assert "field 'agents'=4 must be a multiple of pipeline_stages=3" in result.output


def test_a_stage_no_board_can_hold_fails_naming_stage_board_and_megabytes() -> None:
    result = runner.invoke(app, [
        "simulate", "--fleet", "rpi-zero-2w:2", "--pipeline-stages", "2",
        "--model", "mlp:4096x4096", "--rounds", "1",
    ])  # fmt: skip
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())  # the console wraps long lines
    assert "stage 1 on rpi-zero-2w: layer 3 (Linear) alone needs ~320.6 MB" in text
    assert "its budget is 115 MB" in text


def test_out_writes_the_report_and_the_reassembled_model_as_checked_onnx(tmp_path: Path) -> None:
    result = runner.invoke(app, [
        "simulate", "--agents", "2", "--pipeline-stages", "2", "--rounds", "4",
        "--eval-every", "2", "--out", str(tmp_path), "--json",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    onnx = json.loads(result.stdout)["onnx"]
    assert onnx["checker_ok"] and onnx["parity_ok"]  # all stages, in order, in one graph
    assert onnx["accuracy_onnx"] == pytest.approx(onnx["accuracy_torch"])
    assert (tmp_path / "model.onnx").is_file() and (tmp_path / "report.md").is_file()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["plan"]["stages"][1]["start"] == saved["plan"]["stages"][0]["end"]

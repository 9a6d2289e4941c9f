"""The fleet clock of a pipeline job: board speed, hops and stage rings, bubble included."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from fedring.cli import app
from fedring.config import JobSpec
from fedring.sim.fleet import parse_fleet, step_seconds
from fedring.sim.pipeline_clock import estimate_pipeline


def summary(costs: list[dict[str, float]], rounds: int = 10) -> dict[str, Any]:
    rows = [{"round": r, "accuracy": 0.5 + 0.05 * r} for r in range(rounds)]
    return {"plan": {"host_gflops": 10.0}, "stage_costs": costs, "rows": rows, "rounds": rounds}


def test_one_replica_per_stage_is_the_schedule_at_board_speed_plus_hops() -> None:
    fleet = parse_fleet("rpi4/ethernet:2")  # 2 boards of the same speed
    k = 10.0 / fleet[0].profile.gflops
    cost = {"forward_s": 0.001, "backward_s": 0.002, "ring_compute_s": 0.0,
            "ring_payload_bytes_per_step": 0.0, "activation_bytes": 40_000}  # fmt: skip
    spec = JobSpec(agents=2, pipeline_stages=2, micro_batches=4, pipeline_schedule="gpipe")
    s = summary([cost, {**cost, "activation_bytes": 0}])
    got = estimate_pipeline(spec, s, fleet)
    hop = step_seconds(fleet, 40_000)
    # GPipe, equal stages: (M + S - 1)(f + b) of compute, and one hop each way per pass
    want = (4 + 1) * 3e-3 * k + 2 * hop
    assert got["sim_step_seconds"] == pytest.approx(want)
    assert got["sim_hop_seconds"] == pytest.approx(hop)
    assert got["sim_seconds"] == pytest.approx(10 * want)
    assert got["sim_rounds_to_target"] == 8  # 0.5 + 0.05 * 8 = 0.9
    assert s["rows"][8]["sim_seconds"] == pytest.approx(9 * want)
    assert got["fleet"] == "rpi4-4gb/ethernet:2"


def test_a_slower_stage_board_and_a_stage_ring_lengthen_the_step() -> None:
    cost = {"forward_s": 0.001, "backward_s": 0.002, "ring_compute_s": 0.001,
            "ring_payload_bytes_per_step": 100_000.0, "activation_bytes": 0}  # fmt: skip
    spec = JobSpec(agents=4, pipeline_stages=2)
    even = estimate_pipeline(spec, summary([cost, cost]), parse_fleet("rpi4/ethernet:4"))
    slow = estimate_pipeline(spec, summary([cost, cost]),
                             parse_fleet("rpi4/ethernet:2,rpi3b-plus/ethernet:2"))  # fmt: skip
    assert slow["sim_step_seconds"] > even["sim_step_seconds"]
    assert slow["sim_bubble_fraction"] > even["sim_bubble_fraction"]
    assert even["sim_ring_seconds_per_step"] > 2 * step_seconds(
        parse_fleet("rpi4/ethernet:2"), 100_000.0 / 2
    )  # 2 ring steps of half the payload, plus the compression's CPU time


def test_simulate_with_a_fleet_prints_the_pipeline_clock() -> None:
    result = CliRunner().invoke(app, [
        "simulate", "--fleet", "rpi4:2,rpi3b-plus:2", "--pipeline-stages", "2",
        "--rounds", "4", "--eval-every", "2", "--json",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["fleet"] == "rpi4-4gb/wifi:2,rpi3b-plus/wifi:2"
    assert r["plan"]["stages"][1]["board"] == "rpi3b-plus" and r["sim_seconds"] > 0
    assert 0.0 < r["sim_bubble_fraction"] < 1.0 and r["sim_hop_seconds"] > 0

"""The virtual clock: fleet parsing, ring-step timing by hand, and `simulate --fleet`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fedring.cli import app
from fedring.collective.torus import layout_name
from fedring.config import JobSpec
from fedring.sim.fleet import (
    FleetError,
    HostSpeed,
    estimate,
    parse_fleet,
    ring_steps,
    step_bytes,
    step_seconds,
)

runner = CliRunner()


def test_parse_fleet_expands_counts_and_links() -> None:
    fleet = parse_fleet("rpi4:2, jetson-orin-nano/wifi:1,rpi5")
    assert [m.label for m in fleet] == [
        "rpi4-4gb/wifi", "rpi4-4gb/wifi", "jetson-orin-nano/wifi", "rpi5/wifi",
    ]  # fmt: skip
    bad_values = [
        ("rpi9:2", "unknown profile 'rpi9'"), ("rpi4:x", "is not NAME"),
        ("jetson-nano/wifi:2", "no 'wifi' link"), ("rpi4:0", "count 0"),
    ]  # fmt: skip
    for bad, needle in bad_values:
        with pytest.raises(FleetError, match=needle):
            parse_fleet(bad)


def test_ring_steps_by_layout() -> None:
    assert ring_steps("ring of 8", 8) == 14
    assert ring_steps("torus 3x4", 12) == 2 * 3 + 2 * 2
    assert ring_steps("torus 2x4x4", 32) == 2 * 1 + 2 * 3 + 2 * 3
    assert ring_steps(layout_name("auto", 32), 32) == 14
    assert ring_steps("star", 5) == 2


def test_step_time_on_shared_wifi_and_on_switched_ethernet() -> None:
    wifi = parse_fleet("rpi4/wifi:8")
    # 8 agents share 100 Mbit/s, each sends and receives 10 kB, plus 2 x 2 ms latency
    assert step_seconds(wifi, 10_000) == pytest.approx(2 * 8 * 10_000 * 8 / 100e6 + 0.004)
    eth = parse_fleet("rpi4/ethernet:8")
    # full duplex per port, but the broker's port carries 8 x 10 kB: it is the bottleneck
    assert step_seconds(eth, 10_000) == pytest.approx(8 * 10_000 * 8 / 940e6 + 0.0004)


def _summary() -> dict:
    rows = [
        {"round": 1, "bytes_sent": 1000, "interval": 4},
        {"round": 2, "bytes_sent": 2000, "interval": 4, "accuracy": 0.95},
        {"round": 3, "bytes_sent": 5000, "interval": 4},
    ]
    return {"rows": rows, "layout": "ring of 2"}


def test_estimate_adds_compute_of_the_slowest_board_and_the_ring_steps() -> None:
    spec = JobSpec(agents=2)
    host = HostSpeed(step_s=0.001, gflops=80.0)
    summary = _summary()
    fleet = parse_fleet("rpi4/ethernet:1,rpi-zero-2w:1")
    got = estimate(spec, summary, fleet, host)
    compute = 0.001 * 80.0 / 0.37  # the Zero 2 W is the slowest; sync mode: one step a round
    comm = [2 * step_seconds(fleet, b / 2) for b in (1000, 1000, 3000)]
    want = [compute + comm[0], 2 * compute + sum(comm[:2]), 3 * compute + sum(comm)]
    assert [r["sim_seconds"] for r in summary["rows"]] == pytest.approx(want)
    assert got["sim_seconds"] == pytest.approx(want[-1])
    assert got["sim_rounds_to_target"] == 2 and got["sim_seconds_to_target"] == pytest.approx(
        want[1]
    )
    assert got["fleet"] == "rpi4-4gb/ethernet:1,rpi-zero-2w/wifi:1"


def test_one_step_collectives_count_the_payloads_each_downlink_carries() -> None:
    assert step_bytes("fanout of 4", 4, 1000) == 3000  # the other three members' payloads
    assert step_bytes("hub of 4", 4, 1000) == 4000
    assert step_bytes("ring of 4", 4, 1000) == 1000
    spec, host = JobSpec(agents=2), HostSpeed(step_s=0.001, gflops=80.0)
    fleet = parse_fleet("rpi4/wifi:4")
    times = {}
    for layout in ("ring of 4", "fanout of 4"):
        summary = {**_summary(), "layout": layout}
        times[layout] = estimate(spec.replace(agents=4), summary, fleet, host)
    # the same bytes sent: the ring pays 6 steps of one chunk, fanout one step of three
    assert times["fanout of 4"]["sim_comm_seconds_per_round"] < times["ring of 4"][
        "sim_comm_seconds_per_round"]  # fmt: skip
    fan = step_seconds(fleet, 3 * 1000)  # rounds sent 1000, 1000 and 3000 B
    assert times["fanout of 4"]["sim_comm_seconds_per_round"] * 3 == pytest.approx(
        fan + fan + step_seconds(fleet, 3 * 3000))  # fmt: skip


def test_local_steps_multiply_compute_and_async_is_refused() -> None:
    host = HostSpeed(step_s=0.002, gflops=8.0)
    fleet = parse_fleet("rpi4/ethernet:2")
    got = estimate(JobSpec(agents=2, sync="local"), _summary(), fleet, host)
    assert got["sim_compute_seconds_per_round"] == pytest.approx(4 * 0.002)
    with pytest.raises(FleetError, match="async"):
        estimate(JobSpec(agents=2, sync="async"), _summary(), fleet, host)


def _run(*extra: str) -> dict:
    args = ["simulate", "--fleet", "rpi4:4", "--rounds", "40", "--eval-every", "20", "--json"]
    result = runner.invoke(app, args + list(extra))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_simulate_fleet_prints_sim_seconds_and_compression_cuts_wifi_time() -> None:
    dense, sparse = _run("--compression", "none"), _run("--compression", "group-topk")
    for s in (dense, sparse):
        assert s["fleet"] == "rpi4-4gb/wifi:4" and s["sim_seconds"] > 0
    # the same rounds: on shared Wi-Fi the dense ring's bytes dominate
    assert dense["sim_comm_seconds_per_round"] > 3 * sparse["sim_comm_seconds_per_round"]
    assert dense["sim_seconds"] > 2 * sparse["sim_seconds"]


def test_simulate_fleet_size_must_match_agents() -> None:
    result = runner.invoke(app, ["simulate", "--fleet", "rpi4:2", "--agents", "3"])
    assert result.exit_code == 2 and "--fleet has 2 boards" in result.output

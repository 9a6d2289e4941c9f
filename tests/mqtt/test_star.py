"""A star over a real Mosquitto: four agent daemons, the coordinator at the centre.

With ``topology = "star"`` every agent sends its compressed update to the
coordinator, which combines them (mean, median, trimmed mean: `engine.centre`)
and sends all four the same reply. The job ends with the parameters
`fedring simulate` gives for the same file, bit for bit.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.sim.runner import simulate
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import (
    Fleet,
    checkpoint_round,
    coordinator,
    finish,
    job_toml,
    started,
    wait_for,
)


def _job(tmp: Path, aggregation: str, rounds: int = 30) -> Path:
    return job_toml(tmp, topology="star", aggregation=aggregation, rounds=rounds)


@pytest.mark.parametrize("aggregation", ["mean", "median", "trimmed:0.25"])
def test_star_through_the_coordinator_matches_simulate(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path, aggregation: str
) -> None:
    job = _job(tmp_path, aggregation)
    summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    local = simulate(JobSpec.from_toml(job))
    assert summary["identical_models"] and summary["reformations"] == 0
    assert summary["centre_rounds"] == summary["rounds"] == 30
    # no ring ran: the summary names the star, not a collective it never used
    assert [c["chosen"] for c in summary["collective"]] == ["star"], summary["collective"]
    assert summary["model_hashes"] == local["model_hashes"]
    assert summary["final_accuracy"] == pytest.approx(local["final_accuracy"])
    # Up: one compressed update a round (group-top-k 1%, fp16 values): far below dense.
    dense_up = 30 * local["params"] * 4
    assert 0 < summary["bytes_sent_per_agent_split"]["ring"] < dense_up / 10


def test_star_coordinator_killed_and_resumed_ends_with_the_simulate_hash(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    job = _job(tmp_path, "median", rounds=120)
    out = tmp_path / "run"
    proc = started(broker.url, job, out, 40)
    proc.kill()  # the centre goes with it: the agents' round times out, they halt
    proc.wait(10)
    summary = finish(coordinator(broker.url, job, out, "--resume"))
    assert summary["rounds"] == 120 and summary["identical_models"]
    assert summary["model_hashes"] == simulate(JobSpec.from_toml(job))["model_hashes"]


def test_star_job_re_forms_without_a_killed_agent(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    job = _job(tmp_path, "trimmed:0.25", rounds=150)
    out = tmp_path / "run"
    proc = started(broker.url, job, out, 30)
    fleet.kill("a2", signal.SIGKILL)
    try:
        wait_for(lambda: checkpoint_round(out) >= 60, 90, "round 60 without a2")
    finally:
        fleet.start("a2")
    summary = finish(proc)
    assert any("a2" in e["why"] for e in summary["events"]), summary["events"]
    assert summary["rounds"] == 150 and summary["identical_models"]
    assert summary["reformations"] >= 1


def test_a_sampled_star_matches_simulate_and_only_the_sample_sends(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    """Client sampling: 2 of the 4 agents train each round (seeded), the coordinator
    waits for those two and sends all four the result."""
    job = job_toml(tmp_path, topology="star", rounds=30, sample=2, sit_out="reset")
    summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    local = simulate(JobSpec.from_toml(job))
    assert summary["identical_models"] and summary["centre_rounds"] == 30
    assert summary["model_hashes"] == local["model_hashes"]
    every = simulate(JobSpec.from_toml(job).replace(sample=1.0))
    # the updates sent (the ring's share of every byte a member sent), as simulate counts
    assert summary["bytes_sent_per_agent_split"]["ring"] < 0.6 * every["bytes_sent_per_agent"]

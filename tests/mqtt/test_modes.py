"""The ring's other modes over a real Mosquitto: local SGD (compressed parameter
deltas every H steps) and adaptive H end with `fedring simulate`'s parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.sim.runner import simulate
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import Fleet, coordinator, finish, job_toml


@pytest.mark.parametrize("sync", ["local", "adaptive"])
def test_ring_mode_matches_simulate(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path, sync: str
) -> None:
    job = job_toml(tmp_path, sync=sync, local_steps=4, rounds=40)
    summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    local = simulate(JobSpec.from_toml(job))
    assert summary["identical_models"] and summary["reformations"] == 0
    assert summary["rounds"] == local["rounds"] == 40
    assert summary["model_hashes"] == local["model_hashes"]
    # density auto, resolved by the coordinator: 40 rounds of 4 local steps, closing flush
    assert summary["codec"] == local["codec"]
    assert summary["codec"]["density"] == 0.0375 and summary["codec"]["density_flush"] == 1


@pytest.mark.parametrize("topology", ["ring", "star"])
def test_weighted_over_mqtt_uses_the_shard_size_weights_simulate_uses(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path, topology: str
) -> None:
    """`weighted` with skewed shards: each agent's manifest carries its capped
    shard-size weight (not 1/N), so the job ends with `simulate`'s parameters."""
    job = job_toml(tmp_path, aggregation="weighted", sharding="quantity:1.0",
                   topology=topology, rounds=30)  # fmt: skip
    summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    spec = JobSpec.from_toml(job)
    local = simulate(spec)
    assert summary["identical_models"]
    assert summary["model_hashes"] == local["model_hashes"]
    assert local["model_hashes"] != simulate(spec.replace(aggregation="mean"))["model_hashes"]

"""One-step collectives over a real Mosquitto: four agent daemons run a digits job with
``collective = "fanout"`` and with ``"hub"`` (the job broadcast topic carries the
gradients or the hub's sum) and end with `fedring simulate`'s parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.sim.runner import simulate
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import Fleet, coordinator, finish, job_toml


@pytest.mark.parametrize("collective", ["fanout", "hub"])
def test_one_step_collective_matches_simulate(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path, collective: str
) -> None:
    job = job_toml(tmp_path, collective=collective, rounds=30)
    summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    spec = JobSpec.from_toml(job)
    local = simulate(spec)
    assert summary["identical_models"] and summary["reformations"] == 0
    assert summary["rounds"] == local["rounds"] == 30
    assert summary["model_hashes"] == local["model_hashes"]
    # the one-step sum is not the bounded ring's: the test would pass on a ring job too otherwise
    assert local["model_hashes"] != simulate(spec.replace(collective="ring"))["model_hashes"]

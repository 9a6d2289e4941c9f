"""A star over a real Mosquitto: four agent daemons, the coordinator at the centre.

With ``topology = "star"`` every agent sends its compressed update to the
coordinator, which combines them (mean, median, trimmed mean: `engine.centre`)
and sends all four the same reply. The job ends with the parameters
`fedring simulate` gives for the same file, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.sim.runner import simulate
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import Fleet, coordinator, finish

STAR_JOB = """[job]
agents = 4
dataset = "digits"
topology = "star"
aggregation = "{aggregation}"
rounds = {rounds}
eval_every = 10
seed = 0
timeout_s = 20.0
"""


def _job(tmp: Path, aggregation: str, rounds: int = 30) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "star.toml"
    path.write_text(STAR_JOB.format(aggregation=aggregation, rounds=rounds))
    return path


@pytest.mark.parametrize("aggregation", ["mean", "median", "trimmed:0.25"])
def test_star_through_the_coordinator_matches_simulate(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path, aggregation: str
) -> None:
    job = _job(tmp_path, aggregation)
    summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    local = simulate(JobSpec.from_toml(job))
    assert summary["identical_models"] and summary["reformations"] == 0
    assert summary["centre_rounds"] == summary["rounds"] == 30
    assert summary["model_hashes"] == local["model_hashes"]
    assert summary["final_accuracy"] == pytest.approx(local["final_accuracy"])
    # Up: one compressed update a round (group-top-k 1%, fp16 values): far below dense.
    dense_up = 30 * local["params"] * 4
    assert 0 < summary["bytes_sent_per_agent"] < dense_up / 10

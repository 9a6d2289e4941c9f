"""The 4-agent ring, star and fan-out jobs on each broker of `conftest.BROKERS` end with
the plain Mosquitto's model hashes (and `fedring simulate`'s).

The model (an MLP of 167 k parameters, sent dense) makes the ring's chunks (≈170 KB),
the star's uploads and the fan-out's broadcasts (≈670 KB) and the coordinator's model
frames (≈256 KiB) larger than AWS IoT Core's 128 KiB packets: on the ``aws`` broker
they only arrive because the links cut them into parts (`fedring.transport.mqtt_parts`),
which the ``mqtt_parts_sent`` counter shows. The Mosquitto reference runs first in this
module (its broker parameter comes first); a test selected without it still checks
against `simulate`, whose hashes tests/mqtt shows equal to Mosquitto's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedring.config import JobSpec
from fedring.sim.runner import simulate
from tests.brokers.conftest import Broker
from tests.mqtt.conftest import Fleet, coordinator, finish, job_toml

JOBS: dict[str, dict[str, Any]] = {
    "ring": {"topology": "ring"},
    "star": {"topology": "star"},
    "fanout": {"collective": "fanout"},
}
REFERENCE: dict[str, list[str]] = {}  # job -> the plain Mosquitto's model hashes


@pytest.fixture(scope="module")
def fleet(broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Four agent daemons on `broker`, serving its three jobs one after the other."""
    f = Fleet(broker.agents_url, tmp_path_factory.mktemp(f"{broker.name}-logs"))
    for i in range(4):
        f.start(f"a{i}")
    yield f
    codes = f.stop()
    assert codes == dict.fromkeys(codes, 0), codes


def job_file(tmp: Path, job: str) -> Path:
    return job_toml(tmp, model="mlp:512x256", compression="none", rounds=4, eval_every=4,
                    timeout_s=30.0, **JOBS[job])  # fmt: skip


@pytest.mark.parametrize("job", list(JOBS))
def test_job_ends_with_the_mosquitto_hashes(
    broker: Broker, fleet: Fleet, tmp_path: Path, job: str
) -> None:
    path = job_file(tmp_path, job)
    run = coordinator(broker.coordinator_url, path, tmp_path / "run")
    summary = finish(run, 120)
    assert summary["identical_models"] and summary["rounds"] == 4
    assert summary["model_hashes"] == simulate(JobSpec.from_toml(path))["model_hashes"]
    if broker.name == "mosquitto":
        REFERENCE[job] = summary["model_hashes"]
    elif job in REFERENCE:
        assert summary["model_hashes"] == REFERENCE[job]
    if broker.name == "aws":  # the job's big messages went out in parts, on every link
        counters = [summary["coordinator_counters"], *summary["agent_counters"].values()]
        assert len(counters) == 5 and all(c.get("mqtt_parts_sent", 0) > 0 for c in counters)


def test_the_aws_agents_learnt_the_cap_from_the_connack(broker: Broker, fleet: Fleet) -> None:
    """Runs after the jobs (module order): each agent's log says it took the broker's
    announced cap, and none was dropped for a packet over it."""
    if broker.name != "aws":
        pytest.skip("only the aws broker announces a packet cap")
    for agent in ("a0", "a1", "a2", "a3"):
        log = fleet.log(agent)
        assert re.search(r"takes packets of at most 131072 bytes", log), agent
        assert "dropped us after a packet" not in log and "refused message" not in log

"""A mixed-architecture fleet over a real Mosquitto: three daemons, one of which says
it is an aarch64 board and nudges its parameters by about 1e-7 before every round
(``FEDRING_MACHINE``, ``FEDRING_INJECT_DRIFT``: a stand-in for another CPU's
rounding). The coordinator sees two architectures, the ring re-syncs to its head
every `resync_every` rounds, and the job ends in lock-step with the drift reported.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.sim.runner import simulate
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import Fleet, coordinator, finish, job_toml

OTHER = "aarch64" if platform.machine() != "aarch64" else "x86_64"


@pytest.fixture
def mixed(broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    env = {"m2": {"FEDRING_MACHINE": OTHER, "FEDRING_INJECT_DRIFT": "1e-7"}}
    f = Fleet(broker.url, tmp_path_factory.mktemp("logs"), env=env)
    for i in range(3):
        f.start(f"m{i}")
    yield f
    f.stop()


def test_mixed_fleet_resyncs_reports_drift_and_ends_in_lock_step(
    broker: Mosquitto, mixed: Fleet, tmp_path: Path
) -> None:
    job = job_toml(tmp_path, agents=3, rounds=60, resync_every=20)
    summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    assert summary["reformations"] == 0 and summary["epochs"] == 1
    assert sorted(summary["members"]) == ["m0", "m1", "m2"] and summary["rounds"] == 60
    machines = summary["machines"]
    assert machines["m2"] == OTHER and machines["m0"] == machines["m1"] == platform.machine()
    assert summary["identical_models"], summary["model_hashes"]
    assert "hash_mismatch" not in summary["coordinator_counters"]
    drift = summary["drift"]
    assert drift["resync_every"] == 20 and drift["resyncs"] == 3  # rounds 20, 40, 60
    head = summary["members"][0]
    for agent, d in drift["by_member"].items():
        if machines[agent] == machines[head]:
            assert d == {"max_abs": 0.0, "l2": 0.0}, (agent, drift)  # same bits as the head
        else:
            assert 1e-8 < d["max_abs"] < 1e-4 and d["l2"] >= d["max_abs"], (agent, drift)
    clean = simulate(JobSpec.from_toml(job))
    assert abs(summary["final_accuracy"] - clean["final_accuracy"]) < 0.03


def test_one_architecture_keeps_simulates_hash(
    broker: Mosquitto, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Without FEDRING_MACHINE the same daemons are one architecture: no re-sync,
    simulate's exact hash (the default policy costs an all-x86 fleet nothing)."""
    f = Fleet(broker.url, tmp_path_factory.mktemp("logs"))
    try:
        for i in range(3):
            f.start(f"x{i}")
        job = job_toml(tmp_path, agents=3, rounds=30, resync_every=10)
        summary = finish(coordinator(broker.url, job, tmp_path / "run"))
    finally:
        f.stop()
    assert summary["drift"]["resyncs"] == 0
    assert summary["model_hashes"] == simulate(JobSpec.from_toml(job))["model_hashes"]

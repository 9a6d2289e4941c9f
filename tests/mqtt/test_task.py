"""A user's own task (examples/own_model.py's DiabetesTask: BatchNorm regressor, MSE,
AdamW) run by four agent daemons and a coordinator over a real Mosquitto.

The daemons load the task from their own copy of the module because their command
line allows it (`--allow-task-module examples.own_model`); the coordinator sends
only its name, version and source sha256. One daemon without the flag refuses.
"""

from __future__ import annotations

import runpy
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.sim.runner import simulate
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import Fleet, coordinator, finish

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "own_model.toml"
ALLOW = ["--allow-task-module", "examples.own_model"]


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Daemons and coordinator import `examples.own_model` from the checkout."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with Mosquitto(workdir=tmp_path / "broker") as b:
        yield b


def test_own_task_over_mqtt_matches_in_process_and_its_dense_run(
    importable: None, broker: Mosquitto, tmp_path: Path
) -> None:
    fleet = Fleet(broker.url, tmp_path / "logs", {f"t{i}": ALLOW for i in range(4)})
    try:
        for i in range(4):
            fleet.start(f"t{i}")
        summary = finish(coordinator(broker.url, JOB, tmp_path / "run", onnx=True), timeout=300)
    finally:
        fleet.stop()
    spec = JobSpec.from_toml(JOB)
    local = simulate(spec)
    dense = simulate(spec.replace(compression="none"))
    tolerance = runpy.run_path(str(ROOT / "examples" / "own_model.py"))["R2_TOLERANCE"]
    assert summary["identical_models"] and summary["rounds"] == spec.rounds
    assert summary["model_hashes"] == local["model_hashes"]  # the same training, bit for bit
    r2 = summary["final_accuracy"]  # the task's metric: test R^2
    assert r2 >= dense["final_accuracy"] - tolerance, (r2, dense["final_accuracy"])
    assert r2 > 0.3  # it learnt: the untrained model's R^2 is about -0.1
    assert "onnx" in summary and "error" not in summary["onnx"]


def test_an_agent_that_does_not_allow_the_module_refuses_and_the_job_fails_clearly(
    importable: None, broker: Mosquitto, tmp_path: Path
) -> None:
    """Never a silent shrink: with one of two agents refusing, the coordinator exits 1
    naming the agent and its reason instead of training on the other alone."""
    fleet = Fleet(broker.url, tmp_path / "logs", {"allowed": ALLOW})
    job = tmp_path / "job.toml"
    job.write_text(JOB.read_text().replace("agents = 4", "agents = 2"))
    try:
        fleet.start("allowed")
        fleet.start("strict")
        proc = coordinator(broker.url, job, tmp_path / "run", "--enrol-timeout", "60")
        try:
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        fleet.stop()
    assert "module 'examples.own_model' is not allowed on this agent" in fleet.log("strict")
    log = " ".join((tmp_path / "run-coordinator.log").read_text().split())  # rich wraps lines
    assert code == 1, log
    assert "1 of the 2 agents the job needs are left after 1 refused it (strict: refused" in log

"""A job that names code or a path, sent by a coordinator over a real Mosquitto to an
agent daemon started with no allowed modules: it must refuse each one (a nack the
coordinator reports, a counted refusal) without importing the module.

The module is on the agent's PYTHONPATH and touches a marker file when imported in a
process whose environment names the marker, here the agent's only: the coordinator
plans its own job and may import it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedring.transport.mosquitto import Mosquitto
from tests.engine.hostile import MARKER_ENV, write_module
from tests.mqtt.conftest import Fleet, coordinator, job_toml

MODULE = "hostile_job_code"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with Mosquitto(workdir=tmp_path / "broker") as b:
        yield b


def _refused(url: str, job: Path, out: Path) -> tuple[int, str]:
    """Run the coordinator for `job`; its exit code and its log on one line."""
    proc = coordinator(url, job, out, "--enrol-timeout", "30")
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        code = -1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    return code, " ".join((out.parent / f"{out.name}-coordinator.log").read_text().split())


def test_an_agent_refuses_every_field_that_names_code_and_never_imports_it(
    broker: Mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_module(tmp_path / "mods", MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "mods"))  # the agent's and the coordinator's
    marker, data = tmp_path / "imported", tmp_path / "data"
    data.mkdir()
    outside = tmp_path / "outside.npz"  # readable by the coordinator, outside the agent's data
    np.savez(outside, x=np.random.default_rng(0).standard_normal((40, 3)), y=np.arange(40) % 2)
    jobs = {
        "model": {"model": f"{MODULE}:factory"},
        "task": {"task": f"{MODULE}:task"},
        "dataset": {"dataset": f"npz:{outside}"},
    }
    fleet = Fleet(broker.url, tmp_path / "logs", {"strict": ["--data-dir", str(data)]},
                  env={"strict": {MARKER_ENV: str(marker)}})  # fmt: skip
    try:
        fleet.start("strict")
        for field, fields in jobs.items():
            job = job_toml(tmp_path / field, agents=1, rounds=2, **fields)
            code, log = _refused(broker.url, job, tmp_path / field / "run")
            assert code == 1, log
            assert f"strict: refused: field '{field}'" in log, log
            assert not marker.exists(), f"the agent imported {MODULE} for the {field} job"
    finally:
        codes = fleet.stop()
    agent_log = fleet.log("strict")
    assert codes == {"strict": 0}, agent_log[-2000:]
    assert not marker.exists()
    assert "'code_refused': 3" in agent_log, agent_log[-2000:]

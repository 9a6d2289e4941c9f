"""A run whose nodes never enrol (issue 17, item 16): a reason naming them and the
deadline, a summary on disk, and `fedring flower simulate --json` still printing one
JSON object with the failed status and exiting non-zero. In-process grid, no Ray."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message
from typer.testing import CliRunner

from fedring import cli
from fedring.config import JobSpec
from fedring.flower import simulation
from fedring.flower.client_app import app as client_app
from fedring.flower.job import FlowerJob
from fedring.flower.server_app import RunFailed, serve
from tests.flower.inproc_grid import InProcessGrid

SPEC = JobSpec(agents=3, dataset="digits", sync="local", local_steps=2, rounds=2, topology="star")


def _enrol(msg: Message) -> bool:
    return msg.metadata.message_type.endswith(".enrol")


def silent_grid(n: int) -> InProcessGrid:
    grid = InProcessGrid(client_app, n)
    for node in grid.contexts:
        grid.die_when(node, _enrol)
    return grid


def test_nodes_silent_at_enrolment_are_named_with_the_deadline(tmp_path: Path) -> None:
    job = FlowerJob(SPEC, round_timeout_s=1.0, enrol_timeout_s=2.5)
    with pytest.raises(RunFailed) as failed:
        serve(silent_grid(3), job, out=tmp_path)
    reason = str(failed.value)
    assert reason == (
        "failed: 0 of 3 nodes enrolled: "
        "nodes 100, 101, 102: no reply within the 2.5 s enrolment deadline"
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == reason and summary["rounds"] == 0


def _failed_summary(job: FlowerJob, out: Path, **_: Any) -> dict[str, Any]:
    """`simulate` with the engine replaced by the silent in-process grid."""
    with contextlib.suppress(RunFailed):  # serve writes the summary, then raises
        serve(silent_grid(job.spec.agents), job, out=out)
    return simulation.read_summary(out, 1)


def _timed_out(job: FlowerJob, out: Path, **_: Any) -> dict[str, Any]:
    raise simulation.SimulationError("the Flower simulation ran past its 9 s deadline")


@pytest.mark.parametrize(
    ("engine", "says"),
    [(_failed_summary, "nodes 100, 101: no reply within the 300 s"), (_timed_out, "9 s deadline")],
)
def test_cli_json_prints_the_failed_run(
    monkeypatch: pytest.MonkeyPatch, engine: Any, says: str
) -> None:
    monkeypatch.setattr(simulation, "simulate", engine)
    args = ["flower", "simulate", "--clients", "2", "--rounds", "3", "--round-timeout", "1"]
    result = CliRunner().invoke(cli.app, [*args, "--json"])
    assert result.exit_code == 1
    summary = json.loads(result.stdout)
    assert summary["status"].startswith("failed: ") and says in summary["status"]


def test_the_enrolment_deadline_reaches_the_simulation() -> None:
    job = FlowerJob(SPEC, enrol_timeout_s=7.0)
    assert simulation.job_from_json(simulation.job_to_json(job)).enrol_timeout_s == 7.0

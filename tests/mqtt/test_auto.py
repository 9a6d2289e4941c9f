"""``collective = "auto"`` over a real Mosquitto: the coordinator plans each epoch's
collective from the daemons' probes, the agents run what it planned, and the metrics
carry the prediction beside the measured round."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from fedring.collective.cost import ALGORITHMS
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


def test_auto_runs_the_collective_it_planned(broker: Mosquitto, fleet: Fleet,
                                              tmp_path: Path) -> None:  # fmt: skip
    job = job_toml(tmp_path, collective="auto", rounds=30)
    out = tmp_path / "run"
    summary = finish(coordinator(broker.url, job, out))
    [plan] = summary["collective"]
    assert plan["chosen"] in ALGORITHMS and set(plan["predicted_s"]) == set(ALGORITHMS)
    assert plan["members"] == 4 and plan["measured_round_s"] > 0
    assert plan["predicted_round_s"] >= plan["predicted_s"][plan["chosen"]] > 0
    # what ran is what was planned: the job ends where simulate ends with that collective
    local = simulate(JobSpec.from_toml(job).replace(collective=plan["chosen"]))
    assert summary["model_hashes"] == local["model_hashes"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    assert {r["collective"] for r in rows} == {plan["chosen"]}
    assert all(r["collective_predicted_s"] == plan["predicted_s"][plan["chosen"]] for r in rows)


def test_auto_plans_again_when_the_ring_re_forms(broker: Mosquitto, fleet: Fleet,
                                                  tmp_path: Path) -> None:  # fmt: skip
    job = job_toml(tmp_path, collective="auto", rounds=150)
    out = tmp_path / "run"
    proc = started(broker.url, job, out, 20)
    fleet.kill("a2", signal.SIGKILL)
    wait_for(lambda: checkpoint_round(out) >= 50, 90, "round 50 without a2")
    fleet.start("a2")
    summary = finish(proc)
    plans = summary["collective"]
    assert summary["reformations"] >= 1 and len(plans) == summary["epochs"] >= 2
    assert [p["members"] for p in plans][:2] == [4, 3]  # planned for the ring without a2
    assert all(set(p["predicted_s"]) == set(ALGORITHMS) for p in plans)
    n = len(summary["members"])
    assert plans[-1]["members"] == n
    assert summary["layout"] == f"{plans[-1]['chosen']} of {n}"  # (a ring of <= 8: "ring of n")
    assert summary["identical_models"] and summary["rounds"] == 150

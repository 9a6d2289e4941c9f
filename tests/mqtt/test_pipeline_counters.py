"""A pipeline job's stage counters reach its `summary.json` over a real Mosquitto: two
`fedring agent` daemons, one stage each, and `fedring coordinator run`. Stage 0's bye
carries what it counted in the job (`agent_counters`, as a data-parallel job's summary);
stage 1's daemon is the real one with its bye's counters forged (a negative count):
the coordinator refuses that object, counts it (`bad_stage_counters`), logs it naming
the stage and the field, and the job still ends with its model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import Fleet, coordinator, finish, job_toml, wait_for

STEPS, MICRO = 20, 4
FORGER = "a1"  # stage 1 (stages go to the enrolled agents by id)
FORGED = {"pp-grad_sent": -5}
FORGER_MAIN = f"""
import sys
from fedring.cli import main
from fedring.edge_agent.stage import StageHost
StageHost._job_counters = lambda self: {FORGED!r}  # what a hostile board's bye says
sys.argv[0] = "fedring"
main()
"""


@pytest.fixture(scope="module")
def stages(broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """a0 a plain daemon; a1 the same daemon whose stage forges its bye's counters."""
    f = Fleet(broker.url, tmp_path_factory.mktemp("logs"), extra={"a0": ["--threads", "1"]})
    f.start("a0")
    script = f.logs / "forger.py"
    script.write_text(FORGER_MAIN)
    args = [sys.executable, str(script), "-v", "agent", "--broker", broker.url, "--id", FORGER,
            "--threads", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(f.logs / f"{FORGER}.log", "ab") as log:  # stopped by PID with the fleet
        f.procs[FORGER] = subprocess.Popen(args, stdout=log, stderr=log, env=env,
                                           start_new_session=True)  # fmt: skip
    for a in ("a0", FORGER):
        wait_for(lambda a=a: "ready on" in f.log(a), 60, f"{a}'s hello")  # type: ignore[misc]
    yield f
    codes = f.stop()
    assert set(codes.values()) == {0}, codes


def test_stage_counters_reach_the_summary_and_a_forged_object_is_refused(
    broker: Mosquitto, stages: Fleet, tmp_path: Path
) -> None:
    path = job_toml(tmp_path, agents=2, pipeline_stages=2, model="mlp:256x256", rounds=STEPS,
                    lr=0.05, momentum=0.0, compression="none", batch_size=32,
                    micro_batches=MICRO, eval_every=10, timeout_s=10.0)  # fmt: skip
    out = tmp_path / "out"
    printed = finish(coordinator(broker.url, path, out), 120)
    summary = (out / "summary.json").read_text()
    assert printed["agent_counters"] == json.loads(summary)["agent_counters"]
    counters = printed["agent_counters"]
    print("agent_counters:", counters, "coordinator:", printed["coordinator_counters"])
    assert set(counters) == {"a0", FORGER} and printed["rounds"] == STEPS
    # stage 0 sent one activation per micro-batch and step, and no gradient
    assert counters["a0"]["pp-act_sent"] == STEPS * MICRO
    assert "pp-grad_sent" not in counters["a0"]
    assert all(type(v) is int and v > 0 for v in counters["a0"].values())
    # stage 1's forged object is left out, counted once, and logged naming stage and field
    assert counters[FORGER] == {}
    assert printed["coordinator_counters"]["bad_stage_counters"] == 1
    log = " ".join((tmp_path / "out-coordinator.log").read_text().split())
    why = (f"the bye of stage 1 (agent {FORGER}): field 'counters' entry 'pp-grad_sent' = -5: "
           "not a non-negative integer; its counters are left out")  # fmt: skip
    assert why in log, log[-1500:]

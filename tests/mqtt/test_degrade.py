"""A ring that keeps breaking goes on asynchronously, and comes back (SEEDS A).

SEEDS A's exception handling: on a communication interruption, retry
automatically *or degrade to asynchronous updates*. A ring re-formed
`degrade_after` times, each within `degrade_window` rounds of the one before,
goes on through the coordinator as an asynchronous job (the survivors push
deltas, a lost agent is only dropped), and returns to the ring once no agent has
come or gone for `degrade_calm` versions. Here agent a3 dies (`kill -9`), comes
back and dies again: three re-formations; the other three go on asynchronously,
and once nobody came or went for a while, the ring again (a3 rejoins it when back).
"""

from __future__ import annotations

import signal
from pathlib import Path

from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import Fleet, checkpoint_round, finish, job_toml, started, wait_for


def _log(out: Path) -> str:
    return (out.parent / f"{out.name}-coordinator.log").read_text(errors="replace")


def _moves_on(out: Path, what: str) -> None:
    """Wait until the ring has checkpointed 10 more rounds (it re-formed and runs)."""
    at = checkpoint_round(out)
    wait_for(lambda: checkpoint_round(out) >= at + 10, 90, what)


def test_three_broken_rings_go_on_asynchronously_and_back_to_the_ring(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    # lr 0.03 and a target of 0.975 (the ring alone reaches it at round 830 in
    # `fedring simulate`): the asynchronous stretch stays below it. Under CI's load one
    # reached 0.9749 before 5 calm versions at 0.97, and at lr 0.05 (the ring's 0.975 at
    # round 360) one finished asynchronously once the ring's rounds no longer waited for
    # each checkpoint's ack: the ring had run to round 236 while a3 restarted.
    job = job_toml(tmp_path, rounds=2000, eval_every=10, target_accuracy=0.975, lr=0.03,
                   degrade_after=3, degrade_window=1000, degrade_calm=5)  # fmt: skip
    out = tmp_path / "run"
    proc = started(broker.url, job, out, 5)
    try:
        fleet.kill("a3", signal.SIGKILL)  # break 1: a3 lost
        _moves_on(out, "the ring without a3")
        fleet.start("a3")  # break 2: a3 came back
        wait_for(lambda: "a3 came back" in _log(out), 90, "a3 back")
        _moves_on(out, "the ring with a3 again")
        fleet.kill("a3", signal.SIGKILL)  # break 3: lost again -> asynchronous
        fleet.start("a3")  # back meanwhile: the ring gets all four shards again
        summary = finish(proc)
    finally:
        if fleet.procs["a3"].poll() is not None:
            fleet.start("a3")
    whys = [e["why"] for e in summary["events"]]
    print(f"degrade: {summary['final_accuracy']:.4f} at round {summary['rounds']}, "
          f"{summary['wall_seconds']:.1f} s; events {whys}")
    assert summary["degraded"] == 1
    assert any("going on asynchronously" in w for w in whys), whys
    assert any("back to the ring" in w for w in whys), whys
    assert summary["final_accuracy"] >= 0.97 and summary["identical_models"]
    assert summary["layout"].startswith("ring of")  # finished on the ring (a3 in it or not)
    assert checkpoint_round(out) == summary["rounds"]

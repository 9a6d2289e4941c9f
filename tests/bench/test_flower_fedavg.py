"""The Flower FedAvg baseline on loopback: a real SuperLink and SuperNodes, `flwr run`."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from fedring.bench.flower_fedavg import run_flower_fedavg
from fedring.bench.launch import BaselineError, local_host
from tests.bench.launching import RecordingLaunch, processes_mentioning


def test_two_supernodes_learn_and_stop_at_the_target(tmp_path: Path) -> None:
    launch = RecordingLaunch()
    r = run_flower_fedavg(2, launch, local_host, rounds=6, target=0.9, out=tmp_path,
                          timeout_s=240)  # fmt: skip
    assert processes_mentioning(str(tmp_path)) == []
    assert launch.nodes[:3] == ["hub", "a0", "a1"] and set(launch.nodes) == {"hub", "a0", "a1"}
    rows = r["metrics"]
    assert [row["round"] for row in rows] == list(range(len(rows)))
    assert rows[0]["t"] == 0.0 and all(a["t"] < b["t"] for a, b in itertools.pairwise(rows))
    assert rows[0]["accuracy"] < 0.3
    # Stopped after the first round at the target, well before round 6.
    assert rows[-1]["accuracy"] >= 0.9 > max(row["accuracy"] for row in rows[:-1])
    assert r["rounds"] == rows[-1]["round"] < 6
    assert r["seconds_to_target"] == rows[-1]["t"] and r["final_accuracy"] == rows[-1]["accuracy"]
    # Dense fp32 models both ways, one message per client per round.
    model_bytes = r["params"] * 4
    assert r["messages_sent"] == r["replies_received"] == 2 * r["rounds"]
    assert (
        model_bytes * r["rounds"]
        < r["uplink_bytes_per_client"]
        < 1.2 * model_bytes * r["rounds"] + 10_000
    )
    assert r["network_traffic"]["total-bytes"] > r["uplink_bytes_total"]


def test_the_deadline_stops_everything(tmp_path: Path) -> None:
    with pytest.raises(BaselineError):
        run_flower_fedavg(2, RecordingLaunch(), local_host, rounds=50, target=1.0, out=tmp_path,
                          timeout_s=15)  # fmt: skip
    assert processes_mentioning(str(tmp_path)) == []

"""The DDP baseline on loopback: real gloo ranks started through the launcher hook."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from fedring.bench.ddp import run_ddp
from fedring.bench.launch import BaselineError, local_host
from fedring.bench.sessions import free_port
from fedring.config import JobSpec
from fedring.sim.runner import simulate
from tests.bench.launching import RecordingLaunch, processes_mentioning


def test_four_ranks_reach_the_target_like_fedrings_dense_ring(tmp_path: Path) -> None:
    launch = RecordingLaunch()
    r = run_ddp(4, launch, local_host, rounds=300, eval_every=5, target=0.95, out=tmp_path,
                timeout_s=90)  # fmt: skip
    assert launch.nodes == ["a0", "a1", "a2", "a3"]
    assert processes_mentioning(str(tmp_path)) == []
    assert r["final_accuracy"] >= 0.95 and r["seconds_to_target"] is not None
    rows = r["metrics"]
    assert [row["round"] for row in rows] == list(range(5, r["rounds"] + 1, 5))
    assert all(a["t"] < b["t"] for a, b in itertools.pairwise(rows))
    assert rows[0]["accuracy"] < 0.9 <= rows[-1]["accuracy"]
    assert r["lr"] == {"base": 0.025, "peak": 0.1, "warmup_steps": 50}
    ring = int(2 * 3 / 4 * r["params"] * 4 * r["rounds"])
    assert r["ranks"] == [{"rank": k, "source": "analytic", "tx_bytes": ring, "rx_bytes": ring}
                          for k in range(4)]  # fmt: skip
    # Same shards, initial model, batch order and lr schedule as fedring's dense sync
    # ring: the same step reaches the target with the same accuracy (float sums aside).
    ours = simulate(JobSpec(agents=4, compression="none", eval_every=5, target_accuracy=0.95))
    assert r["rounds"] == ours["rounds"]
    assert r["final_accuracy"] == pytest.approx(ours["final_accuracy"], abs=0.01)


def test_a_rank_that_cannot_reach_the_master_fails_the_run_and_nothing_is_left(
    tmp_path: Path,
) -> None:
    port, wrong = free_port(), free_port()
    launch = RecordingLaunch(bend={"a1": (f"127.0.0.1:{port}", f"127.0.0.1:{wrong}")})
    with pytest.raises(BaselineError, match="rank"):
        run_ddp(2, launch, local_host, rounds=20, out=tmp_path, port=port,
                connect_timeout_s=3, timeout_s=60)  # fmt: skip
    assert processes_mentioning(str(tmp_path)) == []
    assert not (tmp_path / "summary.json").exists()


def test_the_deadline_stops_every_rank(tmp_path: Path) -> None:
    launch = RecordingLaunch()
    with pytest.raises(BaselineError, match="not finished"):
        run_ddp(2, launch, local_host, rounds=100_000, target=1.01, out=tmp_path,
                timeout_s=8)  # fmt: skip
    assert processes_mentioning(str(tmp_path)) == []

"""The ring relayed through the ServerApp gives the in-process ring's result, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedring.collective import run_local_ring
from fedring.flower.ring_relay import node_step
from fedring.flower.simulation import simulate_apps
from fedring.training.models import flat_sha256
from tests.flower.ring_apps import TOPK, members, ring_input

ROOT = Path(__file__).resolve().parents[2]


def in_process(n: int) -> tuple[dict[int, tuple[str, str]], list[int]]:
    run = run_local_ring(
        n, lambda ring: ring.allreduce_sparse(TOPK.compress(ring_input(ring.rank)))
    )
    hashes = {r: (flat_sha256(s), flat_sha256(k)) for r, (s, k) in enumerate(run.results)}
    return hashes, run.payload_bytes


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_replayed_steps_equal_the_in_process_ring(n: int) -> None:
    """Relay node_step's frames by hand, as the ServerApp does."""
    own = [TOPK.compress(ring_input(r)) for r in range(n)]
    received: list[list[bytes]] = [[] for _ in range(n)]
    sent = [0] * n
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for _ in range(2 * (n - 1) + 1):
        outs = [node_step(members(n), r, own[r], received[r], sent[r], round=0) for r in range(n)]
        for r, out in enumerate(outs):
            sent[r] += len(out.frames)
            received[(r + 1) % n].extend(out.frames)
            if out.result is not None:
                results[r] = out.result
    assert sorted(results) == list(range(n))
    want, _ = in_process(n)
    got = {r: (flat_sha256(s), flat_sha256(k)) for r, (s, k) in results.items()}
    assert got == want
    assert len({h for h, _ in got.values()}) == 1  # every node holds the same sum


def test_flower_relay_equals_in_process_ring(tmp_path: Path) -> None:
    """Real simulation engine: 3 SuperNodes, one relayed bounded ring of group-top-k inputs."""
    n = 3
    env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "FEDRING_FLOWER_CLIENTS": str(n),
    }
    summary = simulate_apps(
        "tests.flower.ring_apps:server",
        "tests.flower.ring_apps:client",
        n,
        tmp_path,
        timeout_s=240,
        cpus=2,
        env=env,
    )
    want, payload_bytes = in_process(n)
    got = {int(r): tuple(h) for r, h in summary["by_rank"].items()}
    assert got == want
    # Each node moves the ring's chunks, not everyone's payloads: its uplink is its ring
    # frames plus Flower's overhead on 2(N-1)+1 replies, the same for every node.
    ups = sorted(summary["up"].values())
    assert len(ups) == n
    assert ups[-1] - ups[0] < 0.2 * ups[0]
    steps = 2 * (n - 1) + 1
    for up in ups:
        assert max(payload_bytes) < up < max(payload_bytes) + steps * 1500


def test_training_over_the_relayed_ring(tmp_path: Path) -> None:
    """`fedring flower simulate --topology ring`: nodes hold the model, agree on its sha256,
    and move only ring chunks both ways (no dense model comes down after enrolment)."""
    exe = Path(sys.executable).with_name("fedring")
    job = tmp_path / "job.toml"  # 1% from the first round: no DGC warm-up at 25% (as in-process)
    job.write_text("[job]\ndensity = 0.01\ndensity_warmup = 0\n")  # a fixed density: not auto
    args = ["flower", "simulate", "--config", str(job), "--topology", "ring", "--clients", "2",
            "--rounds", "2", "--eval-every", "1", "--cpus", "2", "--timeout", "240",
            "--json"]  # fmt: skip
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert s["status"] == "completed" and s["layout"] == "flower-ring" and s["failures"] == []
    assert s["evals"][-1]["accuracy"] > s["evals"][0]["accuracy"]
    assert len(s["model_sha256_final"]) == 64  # one hash: every node reported the same model
    dense = s["dense_equivalent_uplink_bytes_per_client"]
    assert 0 < s["uplink_bytes_per_client"] * 10 < dense
    # Down: the initial parameters once at enrolment (SEEDS A), then only ring chunks.
    model = 4 * s["params"]
    enrol = s["enrol_downlink_bytes_total"] / 2
    assert 0.8 * model < enrol < 1.2 * model  # deflated
    assert 0 < (s["downlink_bytes_per_client"] - enrol) * 10 < dense

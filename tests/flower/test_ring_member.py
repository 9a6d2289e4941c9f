"""The relayed ring trains through the engine's reducer and distributed optimizer, so it
ends every run on the in-process library's model, bit for bit, with any optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedring.config import JobSpec
from fedring.flower.client_app import app as client_app
from fedring.flower.job import FlowerJob
from fedring.flower.optimizer_state import OptimizerState
from fedring.flower.server_app import run_job
from fedring.flower.simulation import simulate as flower_simulate
from fedring.sim.runner import simulate
from tests.flower.inproc_grid import InProcessGrid

ROOT = Path(__file__).resolve().parents[2]
ADAMW = "tests.flower.adamw_task:AdamWDigits"
RING = JobSpec(agents=3, dataset="digits", topology="ring", sync="sync", lr=0.05, rounds=4,
               eval_every=4)  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [
        {},  # group-top-k with error feedback and the DGC density warm-up: plain EF-SGD
        {"compression": "none"},  # dense: SGD with momentum
        {"sync": "local", "local_steps": 2},  # compressed deltas of momentum-SGD steps
        {"task": ADAMW, "lr": 0.002, "lr_scaling": "sqrt"},  # the task's own AdamW
        {"task": ADAMW, "lr": 0.002, "compression": "none", "aggregation": "weighted"},
    ],
    ids=["ef-sgd", "dense-momentum", "local", "adamw", "adamw-dense-weighted"],
)
def test_relayed_ring_holds_the_in_process_model(changes: dict[str, object]) -> None:
    spec = RING.replace(**changes)
    grid = InProcessGrid(client_app, spec.agents)
    s = run_job(grid, FlowerJob(spec, round_timeout_s=5.0))
    assert s["status"] == "completed" and s["failures"] == []
    local = simulate(spec)
    assert [s["model_sha256_final"]] == local["model_hashes"]
    assert s["model_sha256_final"] != local["model_sha256_initial"]  # it trained
    kept = grid.contexts[100].state.array_records["fedring.node"]
    if spec.task == ADAMW:  # the node stepped the task's AdamW, and kept its moments
        assert "optimizer/0/exp_avg_sq" in kept
    elif spec.compression == "none":  # momentum SGD's buffers
        assert "optimizer/0/momentum_buffer" in kept


def test_optimizer_state_round_trips_through_plain_values() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    saved = OptimizerState.of(opt)
    assert sorted(saved.tensors) == [f"{i}/{n}" for i in (0, 1)
                                     for n in ("exp_avg", "exp_avg_sq", "step")]  # fmt: skip
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    saved.load_into(fresh)
    for p in model.parameters():
        for name, value in opt.state[p].items():
            assert torch.equal(fresh.state[p][name], value), name


def test_adamw_on_the_simulation_engine_equals_the_in_process_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower's simulation engine (Ray), 2 SuperNodes, a compressed relayed ring with the
    task's AdamW: the same sha256 as `fedring simulate` on the same job."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the nodes import the test's task
    spec = RING.replace(agents=2, rounds=3, eval_every=3, task=ADAMW, lr=0.002)
    s = flower_simulate(FlowerJob(spec), tmp_path, timeout_s=240, cpus=2)
    assert s["status"] == "completed" and s["layout"] == "flower-ring"
    assert [s["model_sha256_final"]] == simulate(spec)["model_hashes"]


@pytest.mark.parametrize("field", ["bucket_kb", "update_delay"])
def test_fields_the_relayed_ring_cannot_carry_are_refused_by_name(field: str) -> None:
    """The relay exchanges one whole gradient a round: bucket overlap and the delayed
    update would be ignored silently, so a job asking for them is refused."""
    from fedring.config import SpecError

    spec = JobSpec(agents=2, dataset="digits", topology="ring", **{field: 1 if field ==
                   "update_delay" else 64})  # fmt: skip
    with pytest.raises(SpecError, match=rf"field '{field}'"):
        FlowerJob(spec)

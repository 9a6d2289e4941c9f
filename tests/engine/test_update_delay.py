"""`update_delay = 1`: each agreed gradient applied one round late, its ring run
during the next round's compute (SEEDS D's delayed update)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from fedring import build
from fedring.collective.channel import PeerChannel
from fedring.collective.ring import Ring
from fedring.config import JobSpec, SpecError
from fedring.edge_agent.worker import JobWorker
from fedring.engine.group import local_group
from fedring.engine.loop import LoopSettings, Member, run, train_step
from fedring.engine.optimizer import SyncSettings
from fedring.sim.runner import simulate
from fedring.transport.inproc import InprocTransport
from tests.engine.refusals import assert_refused

SMALL = {"agents": 3, "dataset": "digits", "rounds": 30, "eval_every": 10, "seed": 1}
SLOW_S = 0.05


def test_agents_end_identical_and_learn_with_the_update_delayed() -> None:
    out = simulate(JobSpec(**{**SMALL, "rounds": 200}, update_delay=1))
    assert out["identical_models"]
    assert out["final_accuracy"] > 0.9
    row = out["rows"][-1]
    assert row["step_s"] > 0 and row["compute_s"] > 0 and row["comm_s"] > 0


def test_the_delayed_run_differs_from_the_plain_one() -> None:
    plain = simulate(JobSpec(**SMALL))["model_hashes"]
    assert simulate(JobSpec(**SMALL, update_delay=1))["model_hashes"] != plain


def _solo(model: torch.nn.Module) -> Member:
    """A one-member ring over an in-process channel, training `model` on a small shard
    with plain SGD (no momentum) and the update delayed by one round."""
    spec = JobSpec(agents=1, dataset="synthetic:200:64:10", compression="none", momentum=0.0,
                   batch_size=16, update_delay=1)  # fmt: skip
    task = build.task_of(spec)
    data = task.dataset(spec.seed)
    ring = Ring(PeerChannel(InprocTransport().connect("solo"), "t"), ("solo",))
    member = build.member(spec, task, data, model, data.x_train[:64], data.y_train[:64], ring,
                          rank=0, weight=1.0)  # fmt: skip
    assert member.state.optimizer.settings.update_delay == 1
    return member


def _set_lr(member: Member, lr: float) -> None:
    for group in member.state.optimizer.param_groups:
        group["lr"] = lr


def test_a_round_steps_on_the_previous_rounds_gradient() -> None:
    torch.manual_seed(0)
    member = _solo(torch.nn.Linear(64, 10))
    opt = member.state.optimizer
    _set_lr(member, 0.5)
    w0 = member.state.params
    train_step(member)
    assert torch.equal(member.state.params, w0)  # nothing agreed yet: no step
    g0 = opt.delayed.pending
    assert g0 is not None and opt.delayed.comm is None
    assert opt.grad_norm == pytest.approx(float(g0.norm()))
    train_step(member)
    assert torch.allclose(member.state.params, w0 - 0.5 * g0)  # round 1 applied round 0's
    assert opt.delayed.pending is not None and not torch.equal(opt.delayed.pending, g0)
    assert opt.delayed.comm is None and opt.round == 2


def test_the_ring_runs_while_the_next_gradient_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    member = _solo(torch.nn.Linear(64, 10))
    reducer = member.state.optimizer.reducer
    real_loss = member.loss_fn

    def slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_S)  # forward and backward of a costlier model
        return real_loss(out, target)

    def slow_ring(vec: torch.Tensor, *, scale: float, **_: Any) -> torch.Tensor:
        time.sleep(SLOW_S)
        return vec * scale

    monkeypatch.setattr(member, "loss_fn", slow_loss)
    monkeypatch.setattr(reducer, "allreduce", slow_ring)
    rows = run(member, LoopSettings(rounds=2, eval_every=2)).rows
    assert rows[0]["comm_s"] == 0.0  # round 0: nothing to agree on yet
    times = {k: rows[1][k] for k in ("compute_s", "comm_s", "step_s")}
    assert times["compute_s"] >= SLOW_S and times["comm_s"] >= SLOW_S
    assert times["step_s"] < 0.8 * (times["compute_s"] + times["comm_s"]), times
    assert times["step_s"] <= 1.25 * max(times["compute_s"], times["comm_s"]), times


def test_the_pending_gradient_is_kept_and_restored_with_the_agents_state() -> None:
    spec = JobSpec(agents=2, update_delay=1, rounds=10)
    p = build.plan(spec)
    worker = JobWorker("a", "job", spec, 0, p.manifest.entry(0).to_dict(), p.model_sha256)
    group = local_group(2)[0]
    worker.member = build.member(spec, worker.task, worker.dataset, worker.model, worker.x,
                                 worker.y, group, rank=0, weight=0.5)  # fmt: skip
    opt = worker.member.state.optimizer
    train_step(worker.member)  # round 0 of a segment: no ring, the gradient waits
    pending = opt.delayed.pending
    assert pending is not None and pending.numel() == worker.numel
    kept = pending.clone()
    worker._keep(5)
    pending.zero_()  # the kept state holds a copy
    opt.delayed.pending = torch.ones(worker.numel)
    assert worker.restore(5)
    assert opt.delayed.pending is not None and torch.equal(opt.delayed.pending, kept)
    worker.load(7, worker.params)  # a checkpoint has parameters only
    assert opt.delayed.pending is None
    assert worker.states[7]["optimizer"]["pending"] is None


@pytest.mark.parametrize(
    "changes",
    [{"update_delay": 2}, {"update_delay": 1, "sync": "local"},
     {"update_delay": 1, "bucket_kb": 16}, {"update_delay": 1, "aggregation": "vote"}],
)  # fmt: skip
def test_update_delay_outside_sync_mean_on_a_ring_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises((SpecError, ValueError), match="update_delay"):
        JobSpec(**changes)


@pytest.mark.parametrize("aggregation", ["vote", "hybrid:0.9", "median"])
def test_the_optimizer_refuses_a_delay_outside_mean_or_weighted(aggregation: str) -> None:
    assert_refused(SyncSettings(update_delay=1, aggregation=aggregation),
                   "overlap needs aggregation mean or weighted")  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [{"update_delay": 2}, {"update_delay": 1, "mode": "local"},
     {"update_delay": 1, "bucket_kb": 16}],
)  # fmt: skip
def test_the_optimizer_refuses_what_the_job_spec_refuses(changes: dict[str, Any]) -> None:
    assert_refused(SyncSettings(**changes), "update_delay")

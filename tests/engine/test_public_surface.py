"""What a PyTorch user reaches for in the first hour (issue 30): LR schedulers on the
distributed optimizer itself, bytes through `group.stats()`, the DDP hook from
`fedring`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import fedring
from fedring.collective.channel import CollectiveTimeout
from fedring.transport.base import Deadline
from tests.engine.members import on_threads


def _solo(model: nn.Module, inner: torch.optim.Optimizer) -> fedring.DistributedOptimizer:
    group = fedring.local_group(1)[0]
    reducer = fedring.Reducer(group.collective, sum(p.numel() for p in model.parameters()))
    return fedring.DistributedOptimizer(inner, reducer, model=model)


def _train(opt: fedring.DistributedOptimizer, model: nn.Module,
           sched: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:  # fmt: skip
    lrs = []
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
        lrs.append(opt.optimizer.param_groups[0]["lr"])
    return lrs


def test_step_lr_takes_the_distributed_optimizer() -> None:
    model = nn.Linear(3, 1)
    opt = _solo(model, torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    assert _train(opt, model, sched, 5) == [1.0, 0.5, 0.5, 0.25, 0.25]


def test_one_cycle_lr_takes_the_distributed_optimizer() -> None:
    model = nn.Linear(3, 1)
    opt = _solo(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    lrs = _train(opt, model, sched, 9)
    peak = lrs.index(max(lrs))
    assert max(lrs) == pytest.approx(0.1, rel=0.05) and 0 < peak < 8 and lrs[-1] < 0.01
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.95, abs=0.02)  # cycled back up


def test_group_stats_count_bytes_frames_and_refusals() -> None:
    def agent(rank: int, group: fedring.Group) -> tuple[fedring.GroupStats, int]:
        model = nn.Linear(64, 8)
        torch.manual_seed(rank)
        reducer = fedring.Reducer(group.collective, sum(p.numel() for p in model.parameters()))
        opt = fedring.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           reducer, model=model, initial="trust")  # fmt: skip
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        return group.stats(), group.channel.endpoint.stats.bytes_sent

    out = on_threads(3, agent)
    for stats, wire in out:
        assert stats.bytes_sent == wire > stats.payload_bytes_sent > 0
        assert stats.bytes_received > 0 and stats.frames_sent > 0 and stats.frames_received > 0
        assert stats.refused == 0 and stats.duplicates == 0
    assert sum(s.bytes_sent for s, _ in out) == sum(s.bytes_received for s, _ in out)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out[0][0].bytes_sent = 0  # type: ignore[misc]


def test_group_stats_count_a_refused_frame() -> None:
    a, b = fedring.local_group(2, timeout_s=0.3)
    a.channel.endpoint.send("agent-1", b"not a frame", Deadline.after(1.0))
    with pytest.raises(CollectiveTimeout):  # agent-0 never takes part
        b.collective.allreduce_dense(torch.zeros(4))
    assert b.stats().refused == 1 and a.stats().refused == 0


def test_the_ddp_hook_is_exported() -> None:
    from fedring.engine.ddp_hook import GroupTopKState, group_topk_hook

    assert fedring.group_topk_hook is group_topk_hook
    assert fedring.GroupTopKState is GroupTopKState
    assert {"group_topk_hook", "GroupTopKState", "GroupStats"} <= set(fedring.__all__)

"""What a coordinator hands each stage of a pipeline job, and what a stage hands back.

The coordinator decides the split **once**, from the model's shapes and the enrolled
boards' profiles, and sends the cut points; a stage rebuilds the same plan from
them (`plan_from_shapes` with ``starts``) and never re-derives the split. Costs are
counted, not timed (`flop_costs`: multiply-adds of a micro-batch's forward and
backward), so the same job on the same boards cuts the same way on an idle or a
loaded machine, and the same seed gives the same model hash.

A stage's state travels as one flat float32 vector (`stage_state`): its
``state_dict`` tensors in order, then the optimizer's momentum buffers where it
has momentum. No pickle: the receiver knows every shape from the plan, checks the
length and the sha256, and copies the values in (`load_stage_state`).

    plan = plan_from_shapes(layers, (1, 8, 8), boards, batch_size=32, micro_batches=4,
                            schedule="1f1b")                 # the coordinator
    plan = plan_from_shapes(..., starts=[s.start for s in plan.stages])   # each stage
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fedring.pipeline.cost import LayerCost
from fedring.pipeline.materialize import traced_costs
from fedring.pipeline.partition import Board, StagePlan, partition, split_at
from fedring.training.datasets import Dataset
from fedring.training.sharding import ShardEntry, ShardError, make_shards, shard_data, verify_shard

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class StateMismatch(ValueError):
    """A flat stage state of the wrong length for the stage it is loaded into."""


def flop_costs(
    layers: Sequence[nn.Module], costs: Sequence[LayerCost], rows: int
) -> list[LayerCost]:
    """`costs` with ``seconds`` = one micro-batch's forward + backward at 1 GFLOPS:
    6 flops per parameter per row (per output position for a convolution), plus 3 per
    output entry for layers without parameters. An estimate from shapes alone."""
    out = []
    for layer, c in zip(layers, costs, strict=True):
        positions = math.prod(c.out_shape[1:]) if isinstance(layer, _CONV) else 1
        flops = rows * (6 * c.params * positions + 3 * math.prod(c.out_shape))
        out.append(replace(c, seconds=flops / 1e9))
    return out


def plan_from_shapes(
    layers: Sequence[nn.Module], feature_shape: tuple[int, ...], boards: Sequence[Board], *,
    batch_size: int, micro_batches: int, schedule: str, starts: Sequence[int] | None = None,
) -> StagePlan:  # fmt: skip
    """Stage s on ``boards[s]``: the balanced split within every budget (`partition` on
    `flop_costs`), or the one starting at `starts` (budgets checked alike)."""
    rows = -(-batch_size // micro_batches)
    costs = flop_costs(layers, traced_costs(layers, feature_shape, rows), rows)
    common = dict(micro_batches=micro_batches, schedule=schedule,
                  input_bytes=rows * 4 * math.prod(feature_shape), host_gflops=1.0)  # fmt: skip
    if starts is None:
        return partition(costs, boards, **common)  # type: ignore[arg-type]
    return split_at(costs, boards, list(starts), **common)  # type: ignore[arg-type]


def _momenta(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The momentum buffer of every parameter (zeros before the first step), or none."""
    if optimizer is None or not any(g.get("momentum", 0.0) for g in optimizer.param_groups):
        return []
    out = []
    for p in module.parameters():
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        out.append(buf if buf is not None else torch.zeros_like(p))
    return out


def stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """The stage's ``state_dict`` tensors, then its momentum buffers, as one float32 vector."""
    parts = [t.detach().reshape(-1).float() for t in module.state_dict().values()]
    parts += [b.detach().reshape(-1) for b in _momenta(module, optimizer)]
    return torch.cat(parts) if parts else torch.zeros(0)


def state_numel(module: nn.Module, with_momentum: bool) -> int:
    n = sum(t.numel() for t in module.state_dict().values())
    return n + (sum(p.numel() for p in module.parameters()) if with_momentum else 0)


def load_stage_state(
    module: nn.Module, flat: torch.Tensor, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Copy `flat` (as `stage_state` made it) into `module` and the optimizer's buffers;
    a state without momentum (an initial one) leaves the optimizer as it is."""
    state = module.state_dict()
    momenta = _momenta(module, optimizer)
    bare, full = state_numel(module, False), state_numel(module, bool(momenta))
    if flat.numel() not in (bare, full):
        raise StateMismatch(f"stage state of {flat.numel()} values, the stage holds {full}")
    if flat.numel() == bare:
        momenta = []
    i = 0
    with torch.no_grad():
        for t in state.values():
            t.copy_(flat[i : i + t.numel()].view_as(t))
            i += t.numel()
        if optimizer is not None and momenta:
            for p in module.parameters():
                buf = flat[i : i + p.numel()].view_as(p).clone()
                optimizer.state[p]["momentum_buffer"] = buf
                i += p.numel()


def shard_of(data: Dataset, entry: Any, replica: int, replicas: int, *, scheme: str,
             seed: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Replica `replica`'s shard of `replicas` (`make_shards` with the job's scheme and
    seed, as the in-process grid shards), verified against the coordinator's entry
    (`ShardError` if it differs); D = 1: none (the whole training set)."""
    if replicas == 1:
        return None, None
    got = ShardEntry.from_dict(entry)
    if got.n_agents != replicas or got.rank != replica:
        raise ShardError(f"shard entry {got.rank} of {got.n_agents}, job: replica {replica} "
                         f"of {replicas}")  # fmt: skip
    index = make_shards(data.y_train.numpy(), replicas, scheme, seed)[replica]
    x, y = shard_data(data, index)
    verify_shard(got, replica, x, y)
    return x, y

"""The coordinator's split from shapes and profiles, and a stage's state as flat floats."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedring.firmware_profiles.schema import load_builtin
from fedring.pipeline.assignment import (
    StateMismatch,
    flop_costs,
    load_stage_state,
    plan_from_shapes,
    stage_state,
)
from fedring.pipeline.materialize import materialize, meta_layers, traced_costs
from fedring.pipeline.partition import Board, NoFeasibleSplit

BIG = "mlp:2048x2048x2048x2048"


def test_the_split_is_counted_not_timed_and_a_stage_rebuilds_it_from_the_cut_points() -> None:
    boards = [Board.of(load_builtin("rpi3"))] * 3
    layers = meta_layers(BIG, (1, 8, 8), 10)
    plans = [plan_from_shapes(layers, (1, 8, 8), boards, batch_size=32, micro_batches=4,
                              schedule="1f1b") for _ in range(2)]  # fmt: skip
    assert plans[0] == plans[1]  # nothing measured: the same on any machine load
    plan = plans[0]
    total = sum(s.params for s in plan.stages)
    assert all(s.params < total / 2 and s.memory_mb <= s.budget_mb for s in plan.stages)
    again = plan_from_shapes(layers, (1, 8, 8), boards, batch_size=32, micro_batches=4,
                             schedule="1f1b", starts=[s.start for s in plan.stages])  # fmt: skip
    assert again == plan


def test_flop_costs_follow_parameters_and_leave_shapes_alone() -> None:
    layers = meta_layers("mlp:64x32", (1, 8, 8), 10)
    costs = traced_costs(layers, (1, 8, 8), rows=8)
    flops = flop_costs(layers, costs, rows=8)
    assert [c.out_shape for c in flops] == [c.out_shape for c in costs]
    linear = [c for c in flops if c.name == "Linear"]
    assert linear[0].seconds == pytest.approx(8 * (6 * (64 * 64 + 64) + 3 * 64) / 1e9)
    assert max(c.seconds for c in flops if c.params == 0) < min(c.seconds for c in linear)


def test_a_split_no_board_holds_is_refused_naming_the_stage() -> None:
    layers = meta_layers(BIG, (1, 8, 8), 10)
    with pytest.raises(NoFeasibleSplit, match="stage"):
        plan_from_shapes(layers, (1, 8, 8), [Board("tiny", 1.0, 20.0)] * 3, batch_size=32,
                         micro_batches=4, schedule="1f1b")  # fmt: skip


def _stage(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers = meta_layers("mlp:16x8", (1, 4, 4), 3)
    module = materialize(layers, 0, len(layers), seed=seed)
    return module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def _step(module: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(5, 1, 4, 4, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    module(x).square().mean().backward()
    opt.step()


def test_a_stage_state_carries_parameters_and_momentum_bit_for_bit() -> None:
    a, opt_a = _stage(0)
    for i in range(3):
        _step(a, opt_a, i)
    flat = stage_state(a, opt_a)
    b, opt_b = _stage(1)  # other weights, no momentum yet
    load_stage_state(b, flat.clone(), opt_b)
    for m, o in ((a, opt_a), (b, opt_b)):
        _step(m, o, 7)
    assert torch.equal(stage_state(a, opt_a), stage_state(b, opt_b))


def test_an_initial_state_loads_without_momentum_and_a_wrong_length_is_refused() -> None:
    a, _ = _stage(0)
    b, opt_b = _stage(1)
    load_stage_state(b, stage_state(a), opt_b)  # parameters only: momentum starts afresh
    assert torch.equal(stage_state(b), stage_state(a))
    with pytest.raises(StateMismatch, match="values"):
        load_stage_state(b, torch.zeros(7), opt_b)

"""Stages: measured layer costs, a balanced split within budgets, clear refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedring.firmware_profiles.schema import load_builtin
from fedring.pipeline.cost import LayerCost, StageSplitError, layers_of, measure_layers
from fedring.pipeline.partition import MB, Board, NoFeasibleSplit, partition, split_at


def cost(i: int, seconds: float, param_mb: float = 0.0, act_mb: float = 0.0) -> LayerCost:
    return LayerCost(i, "L", int(param_mb * MB / 4), int(param_mb * MB), (4,), int(act_mb * MB),
                     seconds)  # fmt: skip


def test_measure_layers_counts_params_activations_and_times_the_big_layer_longer() -> None:
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.Linear(512, 4))
    costs = measure_layers(list(model), torch.randn(32, 16), repeats=9)
    assert [c.params for c in costs] == [16 * 512 + 512, 0, 512 * 512 + 512, 512 * 4 + 4]
    assert [c.activation_bytes for c in costs] == [32 * 512 * 4] * 3 + [32 * 4 * 4]
    assert costs[2].out_shape == (512,)
    assert costs[2].seconds > costs[1].seconds  # a 512x512 matmul outweighs a ReLU


def test_layers_of_refuses_a_non_sequential_model() -> None:
    with pytest.raises(StageSplitError, match=r"nn\.Sequential or a list"):
        layers_of(nn.Linear(2, 2))
    assert len(layers_of([nn.Linear(2, 2), nn.ReLU()])) == 2


def test_partition_balances_time_across_equal_boards() -> None:
    costs = [cost(i, t) for i, t in enumerate([1, 1, 1, 1, 4, 1, 1])]
    plan = partition(costs, [Board("b", 1.0, 1e6)] * 3, micro_batches=2, schedule="1f1b",
                     input_bytes=0, host_gflops=1.0)  # fmt: skip
    assert [(s.start, s.end) for s in plan.stages] == [(0, 4), (4, 5), (5, 7)]
    assert plan.bottleneck_s == pytest.approx(2 * 4)  # M micro-batches x the 4 s layer
    assert "stage 1 on b: layers 4..4" in plan.describe()


def test_partition_gives_a_faster_board_more_layers() -> None:
    costs = [cost(i, 1.0) for i in range(6)]
    boards = [Board("slow", 1.0, 1e6), Board("fast", 5.0, 1e6)]
    plan = partition(costs, boards, micro_batches=1, schedule="gpipe", input_bytes=0,
                     host_gflops=1.0)  # fmt: skip
    assert [(s.start, s.end) for s in plan.stages] == [(0, 1), (1, 6)]


def test_partition_respects_the_budget_over_balance() -> None:
    # Balance would put layers 0..1 on stage 0, but their parameters overflow its 40 MB.
    costs = [cost(0, 1.0, param_mb=5), cost(1, 1.0, param_mb=5), cost(2, 0.1), cost(3, 0.1)]
    boards = [Board("small", 1.0, 40), Board("big", 1.0, 1e6)]
    plan = partition(costs, boards, micro_batches=1, schedule="gpipe", input_bytes=0,
                     host_gflops=1.0)  # fmt: skip
    assert [(s.start, s.end) for s in plan.stages] == [(0, 1), (1, 4)]
    assert all(s.memory_mb <= s.budget_mb for s in plan.stages)


def test_no_feasible_split_names_the_stage_and_the_numbers() -> None:
    rpi3 = Board.of(load_builtin("rpi3b-plus"))
    costs = [cost(0, 1.0, param_mb=50), cost(1, 1.0, param_mb=200), cost(2, 1.0, param_mb=10)]
    with pytest.raises(NoFeasibleSplit, match=r"stage 1 on rpi3b-plus: layer 1 \(L\) alone "
                       r"needs ~1000\.0 MB, its budget is 422 MB"):  # fmt: skip
        partition(costs, [rpi3] * 3, micro_batches=1, schedule="gpipe", input_bytes=0,
                  host_gflops=1.0)  # fmt: skip
    with pytest.raises(NoFeasibleSplit, match=r"layers 2\.\.3 are left over"):
        partition([cost(i, 1.0, param_mb=50) for i in range(4)], [rpi3] * 2, micro_batches=1,
                  schedule="gpipe", input_bytes=0, host_gflops=1.0)  # fmt: skip


def test_gpipe_holds_more_activations_than_1f1b() -> None:
    costs = [cost(i, 1.0, act_mb=10) for i in range(4)]
    memory = {}
    for schedule in ("gpipe", "1f1b"):
        plan = split_at(costs, [Board("b", 1.0, 1e6)] * 2, [0, 2], micro_batches=8,
                        schedule=schedule, input_bytes=0, host_gflops=1.0)  # fmt: skip
        memory[schedule] = plan.stages[0].memory_mb
    assert memory["gpipe"] == pytest.approx(8 * 2 * 20)  # 8 held x (values + grads) x 20 MB
    assert memory["1f1b"] == pytest.approx(2 * 2 * 20)  # stage 0 of 2 holds 2


def test_split_at_refuses_bad_cuts() -> None:
    with pytest.raises(StageSplitError, match="do not cut 3 layers into 2"):
        split_at([cost(i, 1.0) for i in range(3)], [Board("b", 1.0, 1e6)] * 2, [0, 3],
                 micro_batches=1, schedule="gpipe", input_bytes=0, host_gflops=1.0)  # fmt: skip

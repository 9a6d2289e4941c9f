"""The pipeline computes exactly the gradient of single-process training on the same
micro-batches (compression off): S = 2, 3, 4, both schedules, any cut points."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedring.engine.reducer import ReducerSettings
from fedring.pipeline.cost import LayerCost
from fedring.pipeline.grid import GridWorker, PipelineSettings, build_grid, run_steps
from fedring.pipeline.partition import Board, StagePlan, split_at
from fedring.pipeline.schedule import SCHEDULES
from fedring.pipeline.stage import WireSettings
from fedring.training.models import flat_grads
from fedring.transport.inproc import InprocTransport

BIG = Board("test-board", 10.0, 1e6)
DENSE = ReducerSettings(compression="none")


def model_of(n_layers: int, seed: int, width: int = 12) -> nn.Sequential:
    """A sequential model of `n_layers` layers: linears and activations, 6 in, 3 classes."""
    gen = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    fan_in = 6
    for i in range(n_layers):
        last = i == n_layers - 1
        if last or i % 2 == 0:
            out = 3 if last else width
            layer = nn.Linear(fan_in, out)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.5)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen) * 0.1)
            layers.append(layer)
            fan_in = out
        else:
            layers.append(nn.Tanh() if i % 4 == 1 else nn.ReLU())
    return nn.Sequential(*layers)


def plan_for(model: nn.Sequential, starts: list[int], m: int, schedule: str) -> StagePlan:
    """A plan with the given cut points (shapes traced on one sample, no timing)."""
    costs, x = [], torch.zeros(1, 6)
    for i, layer in enumerate(model):
        x = layer(x)
        costs.append(LayerCost(i, type(layer).__name__, 0, 0, tuple(x.shape[1:]), 0, 1e-3))
    boards = [BIG] * len(starts)
    return split_at(costs, boards, starts, micro_batches=m, schedule=schedule, input_bytes=0,
                    host_gflops=10.0)  # fmt: skip


def reference_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    """Single process, gradient accumulated over the same micro-batches in order."""
    model = copy.deepcopy(model)
    for xm, ym in zip(torch.tensor_split(x, m), torch.tensor_split(y, m), strict=True):
        (F.cross_entropy(model(xm), ym) * (len(xm) / len(x))).backward()
    return flat_grads(model)


def pipeline_grads(
    model: nn.Sequential, plan: StagePlan, batches: list[tuple[torch.Tensor, torch.Tensor]],
    settings: PipelineSettings,
) -> tuple[torch.Tensor, list[list[GridWorker]]]:  # fmt: skip
    """One step of a grid of len(batches) replicas; each stage's gradient after it."""
    hub = InprocTransport(cooperative=True)
    grid = build_grid(
        list(model), plan, len(batches), settings, loss_fn=F.cross_entropy,
        make_optimizer=lambda mod: torch.optim.SGD(mod.parameters(), lr=0.0),
        reducer_settings=DENSE, data=lambda d: lambda: batches[d], hub=hub,
    )  # fmt: skip
    run_steps(grid, start=0, steps=1, lr_at=lambda step: 0.0, hub=hub)
    return torch.cat([flat_grads(row[0].stage.module) for row in grid]), grid


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, int, list[int], int, int, str]:
    stages = draw(st.sampled_from([2, 3, 4]))
    n_layers = draw(st.integers(stages, 8))
    cuts = sorted(draw(st.sets(st.integers(1, n_layers - 1), min_size=stages - 1,
                               max_size=stages - 1)))  # fmt: skip
    m = draw(st.integers(1, 5))
    rows = draw(st.integers(m, 13))
    return (
        n_layers,
        draw(st.integers(0, 2**16)),
        [0, *cuts],
        m,
        rows,
        draw(st.sampled_from(SCHEDULES)),
    )


@settings(max_examples=40)
@given(cases())
def test_pipeline_gradients_equal_single_process(
    case: tuple[int, int, list[int], int, int, str],
) -> None:
    n_layers, seed, starts, m, rows, schedule = case
    model = model_of(n_layers, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(rows, 6, generator=gen), torch.randint(0, 3, (rows,), generator=gen)
    got, grid = pipeline_grads(model, plan_for(model, starts, m, schedule), [(x, y)],
                               PipelineSettings(m, schedule))  # fmt: skip
    want = reference_grads(model, x, y, m)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    loss = F.cross_entropy(model(x), y)  # the logged loss is the batch's
    assert grid[-1][0].losses[0] == pytest.approx(float(loss.detach()), rel=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_two_replicas_dense_ring_average_their_batches(stages: int, schedule: str) -> None:
    model = model_of(8, stages)
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))
               for _ in range(2)]  # fmt: skip
    starts = [0, 2, 4, 6][:stages]
    got, grid = pipeline_grads(model, plan_for(model, starts, 4, schedule), batches,
                               PipelineSettings(4, schedule))  # fmt: skip
    want = sum(reference_grads(model, x, y, 4) for x, y in batches) / 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for row in grid:  # every replica of a stage holds the same gradient
        torch.testing.assert_close(flat_grads(row[0].stage.module), flat_grads(row[1].stage.module),
                                   rtol=0.0, atol=0.0)  # fmt: skip


def test_fp16_activations_are_close_and_halve_the_bytes() -> None:
    model = model_of(6, 3)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 6, generator=gen), torch.randint(0, 3, (12,), generator=gen)
    plan = plan_for(model, [0, 3], 3, "1f1b")
    sent = {}
    for dtype in ("fp32", "fp16"):
        settings_ = PipelineSettings(3, "1f1b", WireSettings(dtype))  # type: ignore[arg-type]
        got, grid = pipeline_grads(model, plan, [(x, y)], settings_)
        sent[dtype] = sum(row[0].stage.payload_bytes_sent for row in grid)
        torch.testing.assert_close(got, reference_grads(model, x, y, 3), rtol=1e-2, atol=1e-3)
    assert sent["fp16"] * 2 == sent["fp32"]

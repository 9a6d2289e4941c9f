"""One evaluation per distinct model state: the same numbers, the same run, fewer calls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedring.config import JobSpec
from fedring.engine.task import ClassificationTask
from fedring.sim import runner
from fedring.sim.shared_eval import SharedEvaluation, shareable


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_equal_states_are_evaluated_once_and_any_difference_again() -> None:
    calls: list[nn.Module] = []

    def evaluate(model: nn.Module) -> tuple[float, float]:
        calls.append(model)
        model.eval()
        return float(len(calls)), 0.5

    shared = SharedEvaluation(evaluate)
    a, b = _model(0), _model(0)
    b.train()
    assert shared(a) == (1.0, 0.5) and shared(b) == (1.0, 0.5) and calls == [a]
    assert not b.training  # left in eval mode, as the evaluation itself leaves it
    with torch.no_grad():
        b[1].running_mean[0] += 1e-6  # a buffer differs: evaluated on its own
    assert shared(b) == (2.0, 0.5)
    with torch.no_grad():
        a[0].weight[0, 0] = float("nan")  # NaN equals nothing, itself included
    shared(a), shared(a)
    assert len(calls) == 4 and (shared.evaluated, shared.shared) == (4, 1)


def test_only_built_in_tasks_on_built_in_models_share() -> None:
    assert shareable(ClassificationTask("digits", "mlp"))
    assert not shareable(ClassificationTask("digits", "mymodels:net"))


@pytest.mark.parametrize("changes", [{}, {"sync": "local", "local_steps": 2}])
def test_a_run_is_the_same_with_and_without_sharing(
    changes: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = JobSpec(agents=3, rounds=12, eval_every=4, **changes)
    shared = runner.simulate(spec)
    monkeypatch.setattr(runner, "shareable", lambda _task: False)
    alone = runner.simulate(spec)
    assert shared["model_hashes"] == alone["model_hashes"]
    assert shared["evals"] == alone["evals"] and shared["rows"] == _untimed(alone["rows"], shared)


def _untimed(rows: list[dict], like: dict) -> list[dict]:
    """`rows` with the seconds (which differ run to run) taken from `like`'s rows."""
    times = ("compute_s", "comm_s", "step_s")
    pairs = zip(rows, like["rows"], strict=True)
    return [{**r, **{k: o[k] for k in times if k in o}} for r, o in pairs]

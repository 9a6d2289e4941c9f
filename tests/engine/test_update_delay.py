"""`update_delay = 1`: each agreed gradient applied one round late, its ring run
during the next round's compute (SEEDS D's delayed update)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fedring.aggregation.rules import Aggregation
from fedring.collective.channel import PeerChannel
from fedring.collective.ring import Ring
from fedring.config import JobSpec, SpecError
from fedring.edge_agent.worker import JobWorker
from fedring.sim.runner import plan, simulate
from fedring.training.exchange import Exchange
from fedring.training.sync import AgentContext, _delayed_round
from fedring.training.trainer import LocalTrainer
from fedring.transport.inproc import InprocTransport

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


def _solo(model: torch.nn.Module) -> tuple[LocalTrainer, Exchange, JobSpec]:
    trainer = LocalTrainer(model, torch.randn(64, 64), torch.randint(0, 10, (64,)),
                           batch_size=16, momentum=0.0, seed=0, rank=0)  # fmt: skip
    spec = JobSpec(agents=1, compression="none", update_delay=1)
    ring = Ring(PeerChannel(InprocTransport().connect("solo"), "t"), ("solo",))
    return trainer, Exchange.build(ring, spec, sum(p.numel() for p in model.parameters())), spec


def _ctx(trainer: LocalTrainer, ex: Exchange, spec: JobSpec) -> AgentContext:
    x = torch.zeros(1, 64)
    return AgentContext(spec, trainer, ex, x, torch.zeros(1, dtype=torch.long), 1.0)


def test_a_round_steps_on_the_previous_rounds_gradient() -> None:
    torch.manual_seed(0)
    trainer, ex, spec = _solo(torch.nn.Linear(64, 10))
    ctx, agg = _ctx(trainer, ex, spec), Aggregation.parse("mean")
    w0 = trainer.params
    _delayed_round(ctx, agg, 0, 0.5)
    assert torch.equal(trainer.params, w0)  # nothing agreed yet: no step
    g0 = ex.pending
    assert g0 is not None
    _delayed_round(ctx, agg, 1, 0.5)
    assert torch.allclose(trainer.params, w0 - 0.5 * g0)  # round 1 applied round 0's
    assert ex.pending is not None and not torch.equal(ex.pending, g0)


def test_the_ring_runs_while_the_next_gradient_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    trainer, ex, spec = _solo(torch.nn.Linear(64, 10))
    ctx, agg = _ctx(trainer, ex, spec), Aggregation.parse("mean")
    real_gradient = trainer.gradient

    def slow_gradient(*args: Any, **kwargs: Any) -> tuple[float, torch.Tensor]:
        time.sleep(SLOW_S)
        return real_gradient(*args, **kwargs)

    def slow_ring(vec: torch.Tensor, *, scale: float, **_: Any) -> torch.Tensor:
        time.sleep(SLOW_S)
        return vec * scale

    monkeypatch.setattr(trainer, "gradient", slow_gradient)
    monkeypatch.setattr(ex, "reduce", slow_ring)
    _delayed_round(ctx, agg, 0, 0.1)
    _, _, times = _delayed_round(ctx, agg, 1, 0.1)
    assert times["compute_s"] >= SLOW_S and times["comm_s"] >= SLOW_S
    assert times["step_s"] < 0.8 * (times["compute_s"] + times["comm_s"]), times
    assert times["step_s"] <= 1.25 * max(times["compute_s"], times["comm_s"]), times


def test_the_pending_gradient_is_kept_and_restored_with_the_agents_state() -> None:
    spec = JobSpec(agents=2, update_delay=1, rounds=10)
    p = plan(spec)
    worker = JobWorker("a", "job", spec, 0, p.manifest.to_dict(), p.model_sha256)
    worker.exchange = SimpleNamespace(pending=torch.ones(3), ef=None)  # type: ignore[assignment]
    worker._keep(5)
    worker.exchange.pending = torch.zeros(3)
    assert worker.restore(5)
    assert torch.equal(worker.exchange.pending, torch.ones(3))
    worker.load(7, worker.trainer.params)  # a checkpoint has parameters only
    assert worker.exchange.pending is None


@pytest.mark.parametrize(
    "changes",
    [{"update_delay": 2}, {"update_delay": 1, "sync": "local"},
     {"update_delay": 1, "bucket_kb": 16}, {"update_delay": 1, "aggregation": "vote"}],
)  # fmt: skip
def test_update_delay_outside_sync_mean_on_a_ring_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises((SpecError, ValueError), match="update_delay"):
        JobSpec(**changes)

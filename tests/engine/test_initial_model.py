"""Members start from rank 0's model, as DDP's do (issue 30).

The README's library snippet seeds inside each thread; torch's global generator is
shared by threads, so agents could start from different models and train on
silently. `DistributedOptimizer` now sends rank 0's parameters and buffers while it
is built (``initial="broadcast"``), or checks them (``"verify"``)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import fedring
from fedring.training.models import flat_sha256, params_sha256
from tests.engine.members import on_threads

AGENTS = 4


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))


def _state_sha256(model: nn.Module) -> str:
    buffers = [b.reshape(-1).to(torch.float32) for b in model.buffers()]
    return params_sha256(model) + flat_sha256(torch.cat(buffers))


def _snippet(barrier: threading.Barrier | None, **kwargs: object) -> list[tuple[str, str]]:
    """The README's snippet: each thread seeds the (shared) global generator, builds
    its model and wraps AdamW. Returns each member's state hash before and after."""

    def agent(rank: int, group: fedring.Group) -> tuple[str, str]:
        torch.manual_seed(0)  # "the same start everywhere": not with threads
        if barrier is not None:
            barrier.wait()  # every thread seeded before any draws: the race made certain
        model = _model()
        before = _state_sha256(model)
        numel = sum(p.numel() for p in model.parameters())
        settings = fedring.ReducerSettings(compression="group-topk", density=0.01)
        reducer = fedring.Reducer(group.collective, numel, settings)
        fedring.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), reducer,
                                     model=model, **kwargs)  # type: ignore[arg-type]  # fmt: skip
        return before, _state_sha256(model)

    return on_threads(AGENTS, agent)


def test_the_readme_snippet_starts_every_agent_from_rank_0s_model() -> None:
    """Five runs of the snippet: as written (threads race or not), and with the race
    made certain (runs 0, 2, 4); every agent holds rank 0's model once built."""
    for run in range(5):
        race = threading.Barrier(AGENTS) if run % 2 == 0 else None
        hashes = _snippet(race)
        rank0_before = hashes[0][0]
        assert [after for _, after in hashes] == [rank0_before] * AGENTS, f"run {run}"
        if race is not None:  # the race did happen: they had started apart
            assert len({before for before, _ in hashes}) == AGENTS


def test_verify_refuses_a_member_that_starts_elsewhere() -> None:
    with pytest.raises(fedring.InitialModelMismatch, match=r"agent-[123]' starts from other"):
        _snippet(threading.Barrier(AGENTS), initial="verify")


def test_verify_passes_identical_starts_and_trust_exchanges_nothing() -> None:
    start = _model()

    def agent(rank: int, group: fedring.Group, initial: str) -> int:
        model = _model()
        model.load_state_dict(start.state_dict())
        reducer = fedring.Reducer(group.collective, sum(p.numel() for p in model.parameters()))
        fedring.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reducer,
                                     model=model, initial=initial)  # type: ignore[arg-type]  # fmt: skip
        return group.stats().frames_sent

    assert sum(on_threads(AGENTS, lambda r, g: agent(r, g, "verify"))) > 0
    assert sum(on_threads(AGENTS, lambda r, g: agent(r, g, "trust"))) == 0


def test_members_built_one_after_another_rank_0_first() -> None:
    """Rank 0 sends and goes on: a simulator-style loop builds members in turn."""
    groups = fedring.local_group(3, timeout_s=5.0)
    models = []
    for rank, group in enumerate(groups):
        torch.manual_seed(rank)
        model = _model()
        with torch.no_grad():  # buffers differ too, as after a forward in train mode
            model[1].running_mean.add_(rank)
        reducer = fedring.Reducer(group.collective, sum(p.numel() for p in model.parameters()))
        fedring.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reducer,
                                     model=model)  # fmt: skip
        models.append(_state_sha256(model))
    assert len(set(models)) == 1

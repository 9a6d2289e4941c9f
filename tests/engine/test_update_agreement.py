"""Agreeing on the update, not the gradient (`SyncSettings.agree`): momentum SGD and
Adam over a compressed ring step on their own gradient, and the group agrees on the
parameter delta of that step (`engine.sync_settings`)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import fedring
from fedring.engine.plan import plan, prepare
from fedring.engine.sync_settings import SyncSettings, plain_sgd
from fedring.engine.task import ClassificationTask
from fedring.training.models import flat_params, params_sha256
from tests.engine.members import on_threads

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
}


def _opt(
    model: nn.Module, name: str, compression: str = "group-topk", *,
    group: fedring.Group | None = None, model_arg: bool = True, **sync: object,
) -> fedring.DistributedOptimizer:  # fmt: skip
    group = group or fedring.local_group(1)[0]
    numel = sum(p.numel() for p in model.parameters())
    reducer = fedring.Reducer(group.collective, numel, fedring.ReducerSettings(compression))
    return fedring.DistributedOptimizer(OPTIMIZERS[name](model.parameters()), reducer,
                                        fedring.SyncSettings(**sync),  # type: ignore[arg-type]
                                        model=model if model_arg else None)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "compression", "agreement"),
    [
        ("sgd", "group-topk", "gradient"),  # plain EF-SGD: as before, bit for bit
        ("sgd-momentum", "group-topk", "update"),
        ("adam", "group-topk", "update"),
        ("adamw", "group-topk", "update"),
        ("sgd", "none", "gradient"),  # a dense ring: the gradient, whatever the optimizer
        ("sgd-momentum", "none", "gradient"),
        ("adam", "none", "gradient"),
        ("adamw", "none", "gradient"),
    ],
)
def test_auto_agrees_on_the_update_for_all_but_plain_sgd_when_compressed(
    name: str, compression: str, agreement: str
) -> None:
    opt = _opt(nn.Linear(4, 2), name, compression)
    assert opt.agreement == agreement and opt.ahead == (agreement == "update")
    assert plain_sgd(opt.optimizer) == (name == "sgd")


@pytest.mark.parametrize(
    "sync",
    [{"bucket_kb": 1}, {"update_delay": 1}, {"aggregation": "vote"}, {"agree": "gradient"}],
)
def test_auto_keeps_the_gradient_where_the_update_cannot_be_agreed(sync: dict) -> None:
    assert _opt(nn.Linear(4, 2), "adamw", **sync).agreement == "gradient"


def test_without_a_model_auto_keeps_the_gradient() -> None:
    """The view waits for a forward (a hook on the model): no model, no view."""
    opt = _opt(nn.Linear(4, 2), "adamw", model_arg=False)
    assert opt.agreement == "gradient" and not opt.ahead


def test_local_mode_goes_ahead_only_when_asked() -> None:
    for name in OPTIMIZERS:
        assert not _opt(nn.Linear(4, 2), name, mode="local").ahead  # auto: as it was
        assert _opt(nn.Linear(4, 2), name, mode="local", agree="update").ahead
    assert not _opt(nn.Linear(4, 2), "adamw", "none", mode="local", agree="update").ahead


@pytest.mark.parametrize(
    ("sync", "match"),
    [
        ({"agree": "delta"}, "agree='delta' must be one of auto, gradient, update"),
        ({"agree": "gradient", "mode": "local"}, "needs sync mode"),
        ({"agree": "update", "bucket_kb": 1}, "agree='update' needs aggregation mean"),
        ({"agree": "update", "aggregation": "vote"}, "not aggregation='vote'"),
    ],
)
def test_combinations_no_optimizer_runs_are_refused(sync: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyncSettings(**sync).check()


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))


def _steps(opt: fedring.DistributedOptimizer, model: nn.Module, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_members_hold_the_agreed_model_and_train_at_their_view() -> None:
    """Between steps every member holds the same (agreed) model, and evaluation
    (``no_grad``) sees it; the first forward with gradients moves to the view."""

    def agent(rank: int, group: fedring.Group) -> list[str]:
        model = _net()
        opt = _opt(model, "adamw", group=group)
        hashes = []
        for i, (x, y) in enumerate(_batches(6, seed=rank)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            # at the view: the agreed model until error feedback holds something
            assert torch.equal(flat_params(model), opt.anchor) == (i == 0)
            opt.step()
            assert torch.equal(flat_params(model), opt.anchor)
            with torch.no_grad():
                model(x)
            assert torch.equal(flat_params(model), opt.anchor)  # evaluation: no move
            hashes.append(params_sha256(model))
        opt.close()
        return hashes

    hashes = on_threads(3, agent)
    assert hashes[0] == hashes[1] == hashes[2]
    assert len(set(hashes[0])) == 6  # it trained


@pytest.mark.parametrize("mode", ["sync", "local"])
def test_state_dict_round_trips_and_training_goes_on_bit_for_bit(mode: str) -> None:
    batches = _batches(12)
    model = _net()
    opt = _opt(model, "adamw", mode=mode, local_steps=3, agree="update")
    _steps(opt, model, batches[:7])  # local mode: stops between two syncs
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _steps(opt, model, batches[7:])

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    again = _net()
    again.load_state_dict(saved["model"])
    opt2 = _opt(again, "adamw", mode=mode, local_steps=3, agree="update")
    opt2.load_state_dict(saved["opt"])
    _steps(opt2, again, batches[7:])
    assert params_sha256(again) == params_sha256(model)
    assert torch.equal(opt2.anchor, opt.anchor)


def test_an_lr_scheduler_drives_the_update_agreement() -> None:
    model = _net()
    opt = _opt(model, "sgd-momentum")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    lrs = []
    for x, y in _batches(5):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        lrs.append(opt.optimizer.param_groups[0]["lr"])
    assert opt.agreement == "update" and lrs == [0.1, 0.05, 0.05, 0.025, 0.025]


def test_plain_sgd_auto_is_the_gradient_agreement_bit_for_bit() -> None:
    batches = _batches(5)
    hashes = []
    for agree in ("auto", "gradient"):
        model = _net()
        _steps(_opt(model, "sgd", agree=agree), model, batches)
        hashes.append(params_sha256(model))
    assert hashes[0] == hashes[1]


def _digits(compression: str, name: str, steps: int) -> float:
    """4 members on digits, `steps` steps of batch 32; held-out accuracy."""
    task = ClassificationTask("digits", "mlp")
    p = plan(task, agents=4, seed=0)
    inner = {"adamw": lambda q: torch.optim.AdamW(q, lr=6e-3),
             "sgd-momentum": lambda q: torch.optim.SGD(q, lr=0.1, momentum=0.9)}[name]  # fmt: skip

    def agent(rank: int, group: fedring.Group) -> float:
        model, x, y = prepare(task, p.dataset, p.manifest, p.shards[rank], rank, seed=0,
                              model_sha256=p.model_sha256, initial=p.initial)  # fmt: skip
        numel = sum(q.numel() for q in model.parameters())
        reducer = fedring.Reducer(group.collective, numel, fedring.ReducerSettings(compression))
        opt = fedring.DistributedOptimizer(inner(model.parameters()), reducer, model=model,
                                           initial="trust")  # fmt: skip
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            idx = torch.randint(len(x), (32,), generator=g)
            opt.zero_grad()
            task.loss(model(x[idx]), y[idx]).backward()
            opt.step()
        opt.close()
        return task.evaluate(model, p.dataset)[1]

    accuracy = on_threads(4, agent, timeout_s=30.0)
    assert len(set(accuracy)) == 1  # one agreed model
    return accuracy[0]


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_compressed_1pc_keeps_up_with_dense_on_digits(name: str) -> None:
    dense, topk = _digits("none", name, 150), _digits("group-topk", name, 150)
    assert dense > 0.9 and topk > dense - 0.03, (dense, topk)

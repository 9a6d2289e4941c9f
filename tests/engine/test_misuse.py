"""The library refuses misuse loudly (issue 30): each misuse a user met in their first
hour raises an error that names the fix, at construction where it can."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import fedring
from fedring.collective.channel import CollectiveTimeout
from fedring.collective.ring import Ring
from tests.engine.members import on_threads


def _solo_reducer(model: nn.Module, **settings: Any) -> fedring.Reducer:
    group = fedring.local_group(1)[0]
    numel = sum(p.numel() for p in model.parameters())
    return fedring.Reducer(group.collective, numel, fedring.ReducerSettings(**settings))


# -- one check of codec settings, everywhere ------------------------------------------

BAD = [
    ({"compression": "topk"}, "compression='topk' must be one of none, group-topk"),
    ({"compression": "gtopk"}, "compression='gtopk'"),
    ({"density": 0.0}, "density=0.0 must be a number in \\(0, 1\\]"),
    ({"density": -0.1}, "density=-0.1"),
    ({"density": 1.5}, "density=1.5"),
    ({"value_dtype": "fp8"}, "value_dtype='fp8'"),
    ({"group_size": 0}, "group_size=0"),
    ({"policy": "strict"}, "policy='strict'"),
]


@pytest.mark.parametrize(("fields", "match"), BAD)
def test_reducer_settings_refuse_bad_codec_fields(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(fedring.SettingsError, match=match):
        fedring.ReducerSettings(**fields)


@pytest.mark.parametrize(("fields", "match"), BAD)
def test_job_spec_refuses_with_the_same_rule(fields: dict[str, Any], match: str) -> None:
    from fedring.config import JobSpec, SpecError

    rule = match.split(" must be ", 1)[-1] if " must be " in match else ""
    with pytest.raises(SpecError, match=f"field '{next(iter(fields))}'.*{rule}"):
        JobSpec(**fields)
    with pytest.raises(fedring.SettingsError):  # the same check as the library's
        fedring.ReducerSettings(**fields)


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5])
def test_ddp_hook_and_flower_mod_share_the_check(density: float) -> None:
    with pytest.raises(fedring.SettingsError, match=f"density={density}"):
        fedring.GroupTopKState(density=density)
    pytest.importorskip("flwr")
    from fedring.flower.mod import make_group_topk_mod

    with pytest.raises(fedring.SettingsError, match=f"density={density}"):
        make_group_topk_mod(density=density)


def test_value_dtype_default_is_shared_by_reducer_and_ddp_hook() -> None:
    assert fedring.ReducerSettings().value_dtype == "fp16"
    assert fedring.GroupTopKState().compressor.value_dtype == "fp16"


# -- the distributed optimizer's construction ------------------------------------------


def test_model_must_be_named() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match="needs model=: pass model=your_model"):
        fedring.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     _solo_reducer(model))  # fmt: skip
    fedring.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 _solo_reducer(model), model=None)  # fmt: skip  # a choice


@pytest.mark.parametrize("bucket_kb", [0, 1])  # with and without bucket overlap
def test_a_frozen_parameter_gets_no_gradient_and_no_weight_decay(bucket_kb: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    opt = fedring.DistributedOptimizer(inner, _solo_reducer(model, compression="none"),
                                       fedring.SyncSettings(bucket_kb=bucket_kb),
                                       model=model)  # fmt: skip
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    assert model[0].weight.grad is None
    assert torch.equal(model[0].weight, frozen)


def test_only_running_statistics_are_averaged_not_every_float_buffer() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)
            self.register_buffer("scale", torch.ones(4))  # each member's own

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x)) * self.scale

    def agent(rank: int, group: fedring.Group) -> tuple[list[float], list[float]]:
        torch.manual_seed(0)
        model = Scaled()
        reducer = fedring.Reducer(group.collective, sum(p.numel() for p in model.parameters()))
        opt = fedring.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           reducer, model=model)  # fmt: skip
        model.scale.fill_(rank + 1.0)  # set after the start, per member
        opt.zero_grad()
        model(torch.randn(8, 4) + rank).sum().backward()
        opt.step()
        return model.scale.tolist(), model.norm.running_mean.tolist()

    out = on_threads(3, agent)
    assert [scale for scale, _ in out] == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
    assert out[0][1] == out[1][1] == out[2][1]  # BatchNorm's statistics: averaged


# -- steps --------------------------------------------------------------------------


def test_stepping_the_inner_optimizer_directly_raises_at_once() -> None:
    model = nn.Linear(4, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = fedring.DistributedOptimizer(inner, _solo_reducer(model), model=model)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(fedring.DirectStepError, match=r"call DistributedOptimizer.step\(\)"):
        inner.step()
    opt.step()  # the way in
    opt.close()
    inner.step()  # closed: the inner optimizer is the user's again


def test_a_member_on_another_step_is_named_with_both_steps() -> None:
    def agent(rank: int, group: fedring.Group) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        reducer = fedring.Reducer(group.collective, sum(p.numel() for p in model.parameters()))
        opt = fedring.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           reducer, model=model)  # fmt: skip
        if rank == 1:
            opt.round = 3  # e.g. its state loaded from another checkpoint
        model(torch.randn(2, 4)).sum().backward()
        opt.step()

    # Both members wait on each other, for different rounds: the one whose deadline
    # comes first names the mismatch and leaves, and the other may then see it leave
    # (PeerLost) before its own deadline. One of them must name both steps.
    groups = fedring.local_group(2, timeout_s=5.0)  # the start, too, on a loaded machine
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            agent(rank, groups[rank])
        except Exception as exc:
            errors.append(exc)
            groups[rank].channel.endpoint.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mismatches = [e for e in errors if isinstance(e, fedring.StepMismatch)]
    assert len(errors) == 2 and mismatches, errors
    err = mismatches[0]
    assert isinstance(err, CollectiveTimeout)  # callers that catch timeouts still do
    assert (err.member, err.step, err.peers) in [("agent-0", 0, {"agent-1": 3}),
                                                 ("agent-1", 3, {"agent-0": 0})]  # fmt: skip
    assert "is on step" in str(err)


# -- one timeout story --------------------------------------------------------------


def test_the_reducer_takes_the_groups_timeout_unless_told_otherwise() -> None:
    group = fedring.local_group(2, timeout_s=7.0)[0]
    assert fedring.ReducerSettings().timeout_s is None
    assert fedring.Reducer(group.collective, 10).timeout_s == 7.0
    own = fedring.Reducer(group.collective, 10, fedring.ReducerSettings(timeout_s=90.0))
    assert own.timeout_s == 90.0 and isinstance(group.collective, Ring)
    assert group.collective.timeout_s == 7.0  # the ring's steps keep the group's

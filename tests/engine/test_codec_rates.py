"""``compression = "auto"``'s dense plans train with the dense job's rates (`build.retune`):
momentum SGD at the automatic 0.025 where the job's rates are plain EF-SGD's automatic
ones, and back to EF-SGD's when group-top-k comes back."""

from __future__ import annotations

import torch

from fedring import build
from fedring.config import AUTO_LR, AUTO_LR_EF_SGD, JobSpec
from fedring.edge_agent.worker import JobWorker
from fedring.engine.group import local_group
from fedring.engine.loop import Member


def _member(**fields: object) -> tuple[Member, JobSpec, JobWorker]:
    spec = JobSpec.from_mapping({"agents": 2, "dataset": "synthetic:200:16:4", "seed": 0,
                                 "compression": "auto", "warmup_steps": 0, **fields})  # fmt: skip
    p = build.plan(spec)
    worker = JobWorker("a", "job", spec, 0, p.manifest.entry(0).to_dict(), p.model_sha256)
    worker.member = build.member(spec, worker.task, worker.dataset, worker.model, worker.x,
                                 worker.y, local_group(2)[0], rank=0, weight=0.5)  # fmt: skip
    return worker.member, spec, worker


def _rates(member: Member) -> set[tuple[float, float]]:
    inner = member.state.optimizer.optimizer
    return {(g["initial_lr"], g["momentum"]) for g in inner.param_groups}


def test_an_automatic_rate_switches_with_the_codec_and_back() -> None:
    member, spec, worker = _member()
    assert spec.lr_auto and spec.lr == AUTO_LR_EF_SGD
    assert _rates(member) == {(AUTO_LR_EF_SGD, 0.0)}  # group-top-k: plain EF-SGD
    build.retune(member, spec, worker.task, dense=True)
    assert _rates(member) == {(AUTO_LR, spec.momentum)}
    member.scaling.factor = 0.5  # a halving of the divergence monitor's survives
    member.scaling.apply(0)
    assert member.state.optimizer.param_groups[0]["lr"] == AUTO_LR * 0.5 * 2  # x N = 2
    inner = member.state.optimizer.optimizer
    inner.state[next(iter(worker.model.parameters()))]["momentum_buffer"] = torch.ones(1)
    build.retune(member, spec, worker.task, dense=False)
    assert _rates(member) == {(AUTO_LR_EF_SGD, 0.0)} and not inner.state
    assert member.scaling.factor == 0.5


def test_a_rate_the_user_set_and_a_fixed_codec_keep_their_rates() -> None:
    for fields in ({"lr": 0.05}, {"compression": "group-topk"}, {"momentum_correction": True}):
        member, spec, worker = _member(**fields)
        before = _rates(member)
        assert build.dense_plan_rates(spec, worker.task) is None
        build.retune(member, spec, worker.task, dense=True)
        assert _rates(member) == before


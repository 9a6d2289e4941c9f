"""Where ``JobSpec.lr_auto`` travels (`build.dense_plan_rates`, `build.retune`): the
resolved spec the manifests and checkpoints carry, a checkpoint written before the
field, a rate the user sets over a written-back resolved job file, and a held state
restored before its epoch's codec rates are set (`edge_agent.daemon`: `restore`, then
`JobWorker.run` binds and retunes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedring import build
from fedring.config import AUTO_LR, AUTO_LR_EF_SGD, JobSpec, SpecError
from fedring.edge_agent.worker import JobWorker
from fedring.engine.group import local_group
from fedring.sim.report import write_outputs

AUTO = {"agents": 2, "dataset": "synthetic:200:16:4", "seed": 0, "compression": "auto",
        "warmup_steps": 0}  # fmt: skip


def _worker(spec: JobSpec) -> JobWorker:
    p = build.plan(spec)
    worker = JobWorker("a", "job", spec, 0, p.manifest.entry(0).to_dict(), p.model_sha256)
    worker.member = build.member(spec, worker.task, worker.dataset, worker.model, worker.x,
                                 worker.y, local_group(2)[0], rank=0, weight=0.5)  # fmt: skip
    return worker


def _rates(worker: JobWorker) -> set[tuple[float, float]]:
    assert worker.member is not None
    inner = worker.member.state.optimizer.optimizer
    return {(g["initial_lr"], g["momentum"]) for g in inner.param_groups}


def test_the_resolved_spec_keeps_lr_auto_and_an_older_one_keeps_its_rates() -> None:
    spec = JobSpec.from_mapping(AUTO)
    task = build.task_of(spec)
    sent = JobSpec.from_mapping(spec.resolved())  # a manifest's, a checkpoint's spec
    moved = sent.replace(agents=3)  # the worker's spec of a re-formed ring
    for s in (sent, moved):
        assert s.lr_auto and s.lr == AUTO_LR_EF_SGD
        assert build.dense_plan_rates(s, task) == (AUTO_LR, s.momentum)
    # a checkpoint written before the field: loads, and its dense plans keep EF-SGD's
    # rates (the behaviour before `build.retune`), not a refusal of the resume
    older = JobSpec.from_mapping({k: v for k, v in spec.resolved().items() if k != "lr_auto"})
    assert not older.lr_auto and older.lr == AUTO_LR_EF_SGD
    assert build.dense_plan_rates(older, task) is None


def test_a_rate_set_over_a_written_back_resolved_job_is_left_alone(tmp_path: Path) -> None:
    resolved = JobSpec.from_mapping(AUTO)
    config = Path(write_outputs(tmp_path, resolved, {"rows": []})["config"])
    assert "lr_auto = true" in config.read_text()
    try:
        spec = JobSpec.from_toml(config, {"lr": 0.05})  # `fedring simulate --config ... --lr`
    except SpecError:
        return  # refusing the contradiction, naming the field, would do as well
    assert spec.lr == 0.05
    assert build.dense_plan_rates(spec, build.task_of(spec)) is None


def test_a_held_state_restored_before_the_retune_trains_with_the_new_codecs_rates() -> None:
    worker = _worker(JobSpec.from_mapping(AUTO))
    spec, member = worker.spec, worker.member
    assert member is not None
    worker._keep(30)  # held in a group-top-k epoch: EF-SGD's rates
    build.retune(member, spec, worker.task, dense=True)
    inner = member.state.optimizer.optimizer
    param = next(iter(worker.model.parameters()))
    inner.state[param]["momentum_buffer"] = torch.ones_like(param)
    worker._keep(41)  # held in a dense epoch: the dense job's rates, momentum buffers
    # a re-plan to dense resumes at 30: the snapshot brings EF-SGD's rates back ...
    assert worker.restore(30) and _rates(worker) == {(AUTO_LR_EF_SGD, 0.0)}
    build.retune(member, spec, worker.task, dense=True)  # ... and `run` retunes after
    assert _rates(worker) == {(AUTO_LR, spec.momentum)}
    # a re-plan back to group-top-k resumes at 41: the dense rates and buffers come
    # back with the snapshot, and the retune drops both
    assert worker.restore(41) and inner.state
    build.retune(member, spec, worker.task, dense=False)
    assert _rates(worker) == {(AUTO_LR_EF_SGD, 0.0)} and not inner.state
    # the scaling follows the retuned base rate (x N = 2, no warm-up)
    assert member.scaling.apply(41) == pytest.approx(AUTO_LR_EF_SGD * 2)

"""The gate on the agent: everything a job names that is code (a task, a model factory)
or a path (an ``npz:`` dataset) is resolved against the agent's own configuration,
never taken from the job; the local user's own job (`fedring simulate`, the
coordinator's job file) may name its own modules and files."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedring import build
from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.edge_agent.stage import StageHost
from fedring.edge_agent.worker import JobWorker
from fedring.engine.gate import CodeRefused, Gate
from fedring.engine.task import TaskError
from fedring.wire.control import ControlCodec, ControlMessage
from tests.engine.hostile import MARKER_ENV, write_module


@dataclass(frozen=True)
class Hostile:
    name: str  # an importable module that touches `marker` when imported
    marker: Path


@pytest.fixture
def hostile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hostile]:
    name = f"hostile_{uuid.uuid4().hex[:10]}"
    write_module(tmp_path / "mods", name)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    marker = tmp_path / "imported"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    yield Hostile(name, marker)
    sys.modules.pop(name, None)


def _agent_loads(spec: JobSpec, data_dir: Path | None = None) -> None:
    """What an agent with no allowed modules does with `spec`: the task, its data, its model."""
    task = build.task_of(spec, data_dir, allowed_modules=())
    task.model(task.dataset(spec.seed), spec.seed)


def test_a_model_factory_is_refused_on_an_agent_that_does_not_allow_its_module(
    hostile: Hostile,
) -> None:
    spec = JobSpec(model=f"{hostile.name}:factory")
    with pytest.raises(
        CodeRefused,
        match=rf"field 'model'='{hostile.name}:factory': module "
        rf"'{hostile.name}' is not allowed on this agent.*--allow-task-module",
    ):
        _agent_loads(spec)
    assert not hostile.marker.exists()


def test_a_worker_refuses_a_model_factory_before_importing_it(hostile: Hostile) -> None:
    entry = build.plan(JobSpec(agents=2)).manifest.entry(0).to_dict()  # shards: model-free
    spec = JobSpec(model=f"{hostile.name}:factory", agents=2, rounds=1)
    with pytest.raises(ValueError, match="field 'model'"):
        JobWorker("a0", "j", spec, 0, entry, "0" * 64, allowed_modules=())
    assert not hostile.marker.exists()


def test_an_allowed_factory_module_and_the_users_own_job_import_it(hostile: Hostile) -> None:
    spec = JobSpec(model=f"{hostile.name}:factory")
    task = build.task_of(spec, allowed_modules=(hostile.name,))
    assert hostile.marker.exists()  # allowed: imported (and hashed) by the gate
    assert task.model(task.dataset(0), 0)[1].out_features == 10
    assert build.task_of(spec).name == f"builtin:digits:{hostile.name}:factory"  # own job


def test_a_task_module_is_refused_the_same_way(hostile: Hostile) -> None:
    with pytest.raises(CodeRefused, match=rf"field 'task'='{hostile.name}:task'"):
        _agent_loads(JobSpec(task=f"{hostile.name}:task"))
    assert not hostile.marker.exists()


def test_built_in_models_need_no_allowance() -> None:
    for model in ("mlp", "cnn", "mlp:16x8"):
        _agent_loads(JobSpec(model=model))


def _npz(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.standard_normal((20, 3)), y=np.arange(20) % 2)
    return path


def test_an_npz_path_must_stay_under_the_agents_data_dir(tmp_path: Path) -> None:
    data, outside = tmp_path / "data", _npz(tmp_path / "outside.npz")
    inside = _npz(data / "in.npz")
    (data / "link.npz").symlink_to(outside)
    for value in ("../outside.npz", str(outside), "link.npz", "sub/../../outside.npz"):
        with pytest.raises(CodeRefused, match=rf"field 'dataset'='npz:{value}'.*outside .*data"):
            _agent_loads(JobSpec(dataset=f"npz:{value}"), data)
    for value in ("in.npz", str(inside), "./in.npz"):
        _agent_loads(JobSpec(dataset=f"npz:{value}"), data)


def test_an_agent_without_a_data_dir_reads_no_npz_file(tmp_path: Path) -> None:
    path = _npz(tmp_path / "any.npz")
    with pytest.raises(CodeRefused, match=r"field 'dataset'.*--data-dir"):
        _agent_loads(JobSpec(dataset=f"npz:{path}"))
    build.task_of(JobSpec(dataset=f"npz:{path}")).dataset(0)  # the user's own job reads it


def test_the_refusal_names_field_value_and_remedy_and_is_a_task_error() -> None:
    with pytest.raises(CodeRefused) as info:
        Gate(frozenset({"other"})).code("model", "os:system")
    assert (info.value.field, info.value.value) == ("model", "os:system")
    assert "--allow-task-module os" in str(info.value)
    assert isinstance(info.value, TaskError) and isinstance(info.value, ValueError)


def test_an_entry_point_task_is_hashed_by_its_module() -> None:
    resolved = Gate(frozenset()).task("digits")
    assert [s.module for s in resolved.sources] == ["fedring.engine.task"]


def test_a_worker_reads_the_jobs_npz_from_its_data_dir_under_the_jobs_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator's relative path, the agent's own file: the task's name (in the
    manifest's task id) is the job's spec, not the path the agent resolved."""
    coordinator, agent = tmp_path / "coordinator", tmp_path / "agent"
    _npz(coordinator / "set.npz")
    _npz(agent / "set.npz")
    monkeypatch.chdir(coordinator)
    spec = JobSpec(dataset="npz:set.npz", agents=2, rounds=1)
    p = build.plan(spec)
    monkeypatch.chdir(tmp_path)
    worker = JobWorker("a0", "j", spec, 0, p.manifest.entry(0).to_dict(), p.model_sha256,
                       agent, task=p.task_id.to_dict(), allowed_modules=())  # fmt: skip
    assert worker.task.name == "builtin:npz:set.npz:mlp"


def test_a_pipeline_stage_refuses_a_model_factory_with_a_counted_nack(hostile: Hostile) -> None:
    """The daemon's other runner: a stage of a pipeline job passes the same gate."""
    sent: list[tuple[str, str, dict[str, Any]]] = []
    counters = Counters()
    host = StageHost("a0", ControlCodec("a0", counters=counters), counters,
                     lambda job, kind, doc, *_, **__: sent.append((job, kind, doc)),
                     data_dir=None, budget=None, allowed_modules=())  # fmt: skip
    spec = JobSpec(model=f"{hostile.name}:factory", agents=2, pipeline_stages=2)
    doc = {"key": "00" * 32, "job": "j", "epoch": 0, "spec": spec.resolved(), "stage": 0,
           "members": ["a0", "a1"], "starts": [0, 1], "boards": [["a0", 1.0, 1.0]] * 2,
           "params_sha256": "0" * 64}  # fmt: skip
    host._on_manifest(ControlMessage("manifest", "j", "coordinator", 0, doc, b"", True))
    [(job, kind, nack)] = sent
    assert (job, kind) == ("j", "nack") and "field 'model'" in nack["why"]
    assert counters.snapshot()["code_refused"] == 1
    assert not hostile.marker.exists()

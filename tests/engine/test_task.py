"""Tasks on boards: found by entry point or an allowed module, never sent; the manifest's
name, version and source sha256 must match the agent's own copy."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
import uuid
from pathlib import Path

import pytest
import torch

from fedring import build
from fedring.config import JobSpec, SpecError
from fedring.edge_agent.worker import JobRefused, JobWorker
from fedring.engine.gate import CodeRefused, load_task
from fedring.engine.plan import plan
from fedring.engine.task import (
    ClassificationTask,
    TaskError,
    check_task,
    module_source,
    task_id,
)
from fedring.sim.runner import simulate
from fedring.training.datasets import Dataset, DatasetError
from tests.engine.hostile import write_module

ROOT = Path(__file__).resolve().parents[2]
OWN = "examples.own_model:DiabetesTask"


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))


def test_a_module_task_loads_only_where_the_module_is_allowed(importable: None) -> None:
    with pytest.raises(TaskError, match=r"module 'examples\.own_model' is not allowed"):
        load_task(OWN, allowed_modules=())
    task = load_task(OWN, allowed_modules=["examples.own_model"])
    assert task.name == "diabetes-regressor"  # the class was instantiated


def test_an_unknown_entry_point_names_the_group() -> None:
    with pytest.raises(TaskError, match=r"not installed; entry points in 'fedring\.tasks'"):
        load_task("no-such-task")


def test_a_missing_attribute_is_a_task_error(importable: None) -> None:
    with pytest.raises(TaskError, match="cannot be loaded"):
        load_task("examples.own_model:Nope", allowed_modules=["examples.own_model"])


def test_check_task_refuses_another_version_or_source() -> None:
    task = ClassificationTask()
    want = task_id(task).to_dict()
    check_task(task, want)  # its own id passes
    with pytest.raises(TaskError, match="manifest version"):
        check_task(dataclasses.replace(task, version="2"), want)
    with pytest.raises(TaskError, match="manifest sha256"):
        check_task(task, {**want, "sha256": "0" * 64})
    with pytest.raises(TaskError, match="manifest name"):
        check_task(ClassificationTask("synthetic"), want)


def test_spec_task_field_is_validated() -> None:
    assert JobSpec(task=OWN).task == OWN
    with pytest.raises(SpecError, match="field 'task'"):
        JobSpec(task="rm -rf /")


def test_the_coordinators_own_job_file_allows_its_module(importable: None) -> None:
    assert build.task_of(JobSpec(task=OWN)).name == "diabetes-regressor"
    with pytest.raises(TaskError, match="not allowed"):
        build.task_of(JobSpec(task=OWN), allowed_modules=())  # an agent's empty list


def test_regression_targets_are_float_with_zero_classes() -> None:
    x = torch.zeros(4, 2)
    Dataset("reg", x, torch.zeros(4), x, torch.zeros(4), num_classes=0)
    with pytest.raises(DatasetError, match=r"float32/torch\.int64"):
        Dataset("cls", x, torch.zeros(4), x, torch.zeros(4), num_classes=3)


def _worker(spec: JobSpec, task: dict[str, str], allowed: tuple[str, ...]) -> JobWorker:
    p = build.plan(spec)
    return JobWorker("a0", "j", spec, 0, p.manifest.entry(0).to_dict(), p.model_sha256, task=task,
                     allowed_modules=allowed)  # fmt: skip


def test_a_worker_refuses_a_task_it_does_not_allow_or_whose_source_differs(
    importable: None,
) -> None:
    spec = JobSpec(task=OWN, agents=2, rounds=1)
    want = task_id(build.task_of(spec)).to_dict()
    assert _worker(spec, want, ("examples.own_model",)).task.name == "diabetes-regressor"
    with pytest.raises(CodeRefused, match="not allowed on this agent"):
        _worker(spec, want, ())
    with pytest.raises(JobRefused, match="manifest sha256"):
        _worker(spec, {**want, "sha256": "f" * 64}, ("examples.own_model",))
    with pytest.raises(JobRefused, match="must be a table"):
        _worker(spec, "diabetes", ("examples.own_model",))  # type: ignore[arg-type]


def test_plan_of_a_regression_task_ships_its_id(importable: None) -> None:
    task = load_task(OWN, allowed_modules=["examples.own_model"])
    p = plan(task, agents=4, seed=0)
    assert p.task_id.name == "diabetes-regressor" and len(p.task_id.sha256) == 64
    assert sum(p.manifest.sizes) == len(p.dataset.y_train)


def test_built_in_tasks_are_entry_points_and_train_like_the_dataset_fields() -> None:
    """Needs the package installed (`make setup` does `pip install -e`)."""
    assert load_task("mnist1d") == ClassificationTask("mnist1d", "cnn")
    by_name = simulate(JobSpec(task="digits", rounds=5))["model_hashes"]
    assert by_name == simulate(JobSpec(rounds=5))["model_hashes"]


@pytest.mark.parametrize("field", ["task", "model"])
def test_the_task_id_covers_the_module_the_job_names_not_only_the_tasks_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    """`MODULE:ATTR` returning fedring's own `ClassificationTask`, or a `MODULE:FACTORY`
    model: another agent's module of that name, with other code run at import, must
    not pass for the coordinator's."""
    name = f"mine_{field}_{uuid.uuid4().hex[:10]}"
    write_module(tmp_path, name, variant="coordinator's")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = JobSpec(
        agents=2, rounds=1, **{field: f"{name}:{'task' if field == 'task' else 'factory'}"}
    )
    p = build.plan(spec)
    write_module(tmp_path, name, variant="another agent's, longer")  # same name, other code
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    try:
        with pytest.raises(JobRefused, match="manifest sha256"):
            JobWorker("a0", "j", spec, 0, p.manifest.entry(0).to_dict(), p.model_sha256,
                      task=p.task_id.to_dict(), allowed_modules=(name,))  # fmt: skip
    finally:
        sys.modules.pop(name, None)


def test_a_modules_hash_ignores_the_checkouts_line_endings(tmp_path: Path) -> None:
    """A coordinator's Windows checkout (CRLF) and a board's (LF) hash the same."""
    text = "def task():\n    return 1\n"
    lf, crlf = tmp_path / "lf.py", tmp_path / "crlf.py"
    lf.write_bytes(text.encode())
    crlf.write_bytes(text.replace("\n", "\r\n").encode())
    hashes = set()
    for path in (lf, crlf):
        module = types.ModuleType("same")
        module.__file__ = str(path)
        hashes.add(module_source(module))
    assert len(hashes) == 1

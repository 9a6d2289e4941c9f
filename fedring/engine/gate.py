"""The gate: everything a job names that is code or a path, resolved against this
process's own configuration, never against the job's.

A coordinator is trusted with a job's settings and data, not with code on the agents
(docs/ARCHITECTURE, "Trust boundaries"), so every field that names code or a file
passes here, on the agent, before anything of it is imported or read:

- ``task = "MODULE:ATTR"`` and ``model = "MODULE:FACTORY"``: MODULE must be one the
  agent allows (``fedring agent --allow-task-module MODULE``). A task named by
  entry point (group ``fedring.tasks``) is an installed package's, and needs none.
- ``dataset = "npz:PATH"``: PATH, relative or absolute, must resolve (links
  followed) to a file under the agent's ``--data-dir``; an agent without one reads
  no npz file.
- the optimizer: a job has no optimizer field; a task's own ``optimizer()`` comes
  with the task's module, which passed here.

`Gate.own()` is for the local user's own job (`fedring simulate`, the coordinator's
job file): any module, any path. A refusal is a `CodeRefused` naming the field, the
value and how to allow it.

Each module imported here is hashed (its file as it is on disk when the job is
loaded); the task's `TaskId` covers those files and the file of the module that
defines the task's class, not the modules they import in turn.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from fedring.engine.task import (
    GROUP,
    ClassificationTask,
    Source,
    Task,
    TaskError,
    TaskId,
    module_source,
    task_id,
)
from fedring.training.models import factory_module


class CodeRefused(TaskError):
    """A job names code or a path that this agent's own configuration does not allow."""

    def __init__(self, field: str, value: str, why: str) -> None:
        super().__init__(f"field {field!r}={value!r}: {why}")
        self.field, self.value = field, value


@dataclass(frozen=True)
class Resolved:
    """A job's task as this process loaded it, and the modules it imported for it."""

    task: Task
    sources: tuple[Source, ...] = ()

    @property
    def id(self) -> TaskId:
        return task_id(self.task, self.sources)


@dataclass(frozen=True)
class Gate:
    """What a job may name here: modules in `modules` (None: any, the user's own job)
    and ``npz:`` files under `data_dir`."""

    modules: frozenset[str] | None = frozenset()
    data_dir: Path | None = None

    @classmethod
    def own(cls, data_dir: Path | None = None) -> Gate:
        """The local user's own job: any module; npz paths as given (under `data_dir`
        when relative and one is given)."""
        return cls(None, data_dir)

    @classmethod
    def agent(cls, modules: Iterable[str], data_dir: Path | None) -> Gate:
        """An agent's: only `modules`, only files under `data_dir`."""
        return cls(frozenset(modules), data_dir)

    def job(self, task: str, dataset: str, model: str) -> Resolved:
        """The job's task: `task` if named, else the built-in one of `dataset` and `model`."""
        if task:
            return self.task(task)
        sources: tuple[Source, ...] = ()
        if factory_module(model) is not None:
            sources = (self.code("model", model)[1],)
        data = self.dataset(dataset)
        path = data.removeprefix("npz:") if data.startswith("npz:") else ""
        return Resolved(ClassificationTask(dataset, model, path=path), sources)

    def task(self, ref: str) -> Resolved:
        """A task by entry-point name, or ``MODULE:ATTR`` from an allowed module."""
        if ":" in ref:
            factory, source = self.code("task", ref)
        else:
            found = [ep for ep in entry_points(group=GROUP) if ep.name == ref]
            if not found:
                known = sorted(ep.name for ep in entry_points(group=GROUP))
                raise TaskError(f"task {ref!r} is not installed; entry points in {GROUP!r}: "
                                f"{known}")  # fmt: skip
            factory = found[0].load()
            source = module_source(importlib.import_module(found[0].module))
        # A class or a factory function is called; an instance is used as it is.
        make = isinstance(factory, type) or (callable(factory) and not isinstance(factory, Task))
        task = factory() if make else factory
        if not isinstance(task, Task):
            raise TaskError(f"task {ref!r}: {type(task).__name__} lacks the Task members")
        sources = [source]
        model = task.model_spec if isinstance(task, ClassificationTask) else ""
        if (name := factory_module(model)) is not None:  # the task's own choice: hashed
            sources.append(module_source(importlib.import_module(name)))
        return Resolved(task, tuple(sources))

    def code(self, field: str, ref: str) -> tuple[Any, Source]:
        """``MODULE:ATTR``'s attribute and MODULE's source, if MODULE is allowed here."""
        name, _, attr = ref.partition(":")
        if self.modules is not None and name not in self.modules:
            raise CodeRefused(field, ref, f"module {name!r} is not allowed on this agent "
                              f"(start it with --allow-task-module {name}, or install the "
                              "task as a package with a 'fedring.tasks' entry point)")  # fmt: skip
        try:
            module = importlib.import_module(name)
            return getattr(module, attr), module_source(module)
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            raise TaskError(f"field {field!r}={ref!r} cannot be loaded: {exc}") from None

    def dataset(self, spec: str) -> str:
        """`spec`, with an ``npz:`` path made this machine's file (`CodeRefused` if an
        agent's path leaves its data directory)."""
        if not spec.startswith("npz:"):
            return spec
        arg = spec.removeprefix("npz:")
        if self.modules is None:
            return spec if self.data_dir is None else f"npz:{self.data_dir / arg}"
        if self.data_dir is None:
            raise CodeRefused("dataset", spec, "this agent reads no npz file: start it with "
                              "--data-dir DIR and put the file under DIR")  # fmt: skip
        root = self.data_dir.resolve()
        path = (root / arg).resolve()  # links followed: a link out of DIR leaves it too
        if not path.is_relative_to(root):
            raise CodeRefused("dataset", spec, f"resolves to {path}, outside this agent's "
                              f"--data-dir {root}")  # fmt: skip
        return f"npz:{path}"


def load_task(ref: str, allowed_modules: Iterable[str] = ()) -> Task:
    """A task by entry-point name, or ``MODULE:ATTR`` when `MODULE` is allowed."""
    return Gate.agent(allowed_modules, None).task(ref).task

"""Tasks: what a fleet trains — a model factory, a dataset and its shards, a loss, a metric.

A task is any object with the `Task` members, and optionally
``optimizer(model, lr) -> torch.optim.Optimizer`` (else the job's SGD). fedring
ships one kind, `ClassificationTask`, for its built-in datasets (``digits``,
``mnist1d``, ``synthetic``, ``npz:PATH``) and models (``mlp``, ``cnn``,
``MODULE:FACTORY``); ``digits``, ``mnist1d`` and ``synthetic`` are also entry points,
so ``task = "digits"`` finds them the way it finds a user's installed task;
a user brings their own (regression, reconstruction, ...) as a class in an
installed package, registered under the entry-point group ``fedring.tasks``::

    [project.entry-points."fedring.tasks"]
    housing = "my_pkg.tasks:HousingTask"

An agent never runs code the coordinator sends: it loads a task by name from its
own installed packages (or from a module its own configuration allows: the gate,
`engine.gate`, resolves every field of a job that names code or a path), and the
manifest names the task, its version and the sha256 of its source files, which every
agent compares with its own copy before training (`TaskId`, `check_task`).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from fedring.training.datasets import Dataset, load_dataset
from fedring.training.models import build_model

GROUP = "fedring.tasks"
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, target) -> loss


class TaskError(ValueError):
    """A task that cannot be found, loaded, or does not match the manifest's."""


@runtime_checkable
class Task(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    def dataset(self, seed: int) -> Dataset:
        """Train and test tensors (`x_train`, `y_train`, `x_test`, `y_test`)."""
        ...

    def model(self, dataset: Dataset, seed: int) -> nn.Module:
        """A fresh model; the coordinator's initial parameters overwrite its init."""
        ...

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module, dataset: Dataset) -> tuple[float, float]:
        """Held-out loss and metric (higher is better, e.g. accuracy or -MSE)."""
        ...


@dataclass(frozen=True)
class ClassificationTask:
    """A built-in dataset and model spec, cross-entropy loss, accuracy."""

    data_spec: str = "digits"
    model_spec: str = "mlp"
    version: str = "1"
    # The file an ``npz:`` spec names on this machine (an agent's, under its data
    # directory); the name keeps the job's spec, so every member's name is the same.
    path: str = ""

    @property
    def name(self) -> str:
        return f"builtin:{self.data_spec}:{self.model_spec}"

    def dataset(self, seed: int) -> Dataset:
        return load_dataset(f"npz:{self.path}" if self.path else self.data_spec, seed)

    def model(self, dataset: Dataset, seed: int) -> nn.Module:
        return build_model(self.model_spec, dataset.feature_shape, dataset.num_classes, seed)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, dataset: Dataset) -> tuple[float, float]:
        return evaluate_batches(model, dataset.x_test, dataset.y_test, self.loss, _correct)


def digits() -> ClassificationTask:
    """scikit-learn's 8x8 digits with the default MLP (entry point ``digits``)."""
    return ClassificationTask("digits", "mlp")


def mnist1d() -> ClassificationTask:
    """MNIST-1D with the paper's CNN (entry point ``mnist1d``)."""
    return ClassificationTask("mnist1d", "cnn")


def synthetic() -> ClassificationTask:
    """The seeded Gaussian mixture with the default MLP (entry point ``synthetic``)."""
    return ClassificationTask("synthetic", "mlp")


def _correct(out: torch.Tensor, y: torch.Tensor) -> float:
    return float((out.argmax(dim=1) == y).sum())


@torch.no_grad()
def evaluate_batches(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Any, score: Any, batch: int = 2048
) -> tuple[float, float]:
    """Mean loss and mean per-sample `score` of `model` on (x, y), in eval mode."""
    model.eval()
    total, scored = 0.0, 0.0
    for i in range(0, len(x), batch):
        out, yb = model(x[i : i + batch]), y[i : i + batch]
        total += float(loss(out, yb)) * len(yb)
        scored += score(out, yb)
    return total / len(x), scored / len(x)


@dataclass(frozen=True)
class TaskId:
    """What the manifest says of the task: every agent compares its own."""

    name: str
    version: str
    sha256: str  # of the task's source files (`task_id`)

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "sha256": self.sha256}


@dataclass(frozen=True)
class Source:
    """A module a task was loaded from, and the sha256 of its file."""

    module: str
    sha256: str


def module_source(module: ModuleType) -> Source:
    """`module`'s name and the sha256 of its file as it is on disk now, with CRLF read
    as LF so that a checkout's line endings do not count (of its name alone for a
    module without a file: built in, or a namespace package)."""
    file = getattr(module, "__file__", None)
    data = Path(file).read_bytes() if file else f"no file: {module.__name__}".encode()
    data = data.replace(b"\r\n", b"\n")
    return Source(module.__name__, hashlib.sha256(data).hexdigest())


def task_id(task: Task, sources: Iterable[Source] = ()) -> TaskId:
    """`task`'s name, version and one sha256 over the files of `sources` (the modules
    the gate imported for it: the one a ``MODULE:ATTR`` or an entry point names, a
    ``MODULE:FACTORY`` model's) and of the module that defines the task's class.

    Not covered: the modules those import in turn, and installed dependencies."""
    covered = list(sources)
    module = inspect.getmodule(type(task))
    if module is None:
        covered.append(Source(type(task).__qualname__, ""))
    elif module.__name__ not in {s.module for s in covered}:
        covered.append(module_source(module))
    lines = "".join(f"{s.module} {s.sha256}\n" for s in covered)
    return TaskId(task.name, task.version, hashlib.sha256(lines.encode()).hexdigest())


def check_task(task: Task, want: dict[str, Any], sources: Iterable[Source] = ()) -> None:
    """Refuse a task whose name, version or source differs from the manifest's."""
    got = task_id(task, sources)
    for key, mine in got.to_dict().items():
        if want.get(key) != mine:
            raise TaskError(
                f"task {got.name!r}: manifest {key} {str(want.get(key))[:16]!r} != this "
                f"agent's {mine[:16]!r}; install the same task version as the coordinator"
            )

"""A module a hostile job names: it touches a marker file when imported, so a test can
tell whether a process ran it (`write_module`). The marker is `$FEDRING_TEST_MARKER`,
set only for the process under test: a coordinator planning the job may import it."""

from __future__ import annotations

from pathlib import Path

MARKER_ENV = "FEDRING_TEST_MARKER"

SOURCE = '''"""Written by a fedring test: a job's code that no agent should run unasked."""
import math
import os
import pathlib

from torch import nn

from fedring.engine.task import ClassificationTask

VARIANT = {variant!r}  # two variants: the same task and model, other code at import
if os.environ.get({env!r}):
    pathlib.Path(os.environ[{env!r}]).touch()


def factory(feature_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(feature_shape), num_classes))


def task():
    return ClassificationTask("digits", "mlp")
'''


def write_module(folder: Path, name: str, variant: str = "a") -> Path:
    """`folder`/`name`.py: a factory ``factory`` and a task ``task`` (fedring's own
    `ClassificationTask`), and the marker touched at import."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(SOURCE.format(variant=variant, env=MARKER_ENV))
    return path

"""Optional dependencies: what needs which extra, and a clear error when it is missing.

An agent installs only ``fedring`` (torch, numpy, msgpack, paho-mqtt, typer, rich):
`fedring agent` starts without plotting, ONNX, Flower or the dataset packages, and
imports them only when a job needs one (`tests/test_lean.py` checks this). A
missing one is an `MissingExtra` naming the extra to install::

    pip install "fedring[digits]"     # scikit-learn: the digits dataset
    pip install "fedring[mnist1d]"    # mnist1d (with scipy and matplotlib)
    pip install "fedring[datasets]"   # both
    pip install "fedring[onnx]"       # onnx, onnxruntime, onnxscript: export, ORT checks
    pip install "fedring[plot]"       # matplotlib: report.md's plots
    pip install "fedring[flower]"     # flwr[simulation]: `fedring flower ...`
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {  # top-level module -> the extra that installs it
    "sklearn": "digits",
    "mnist1d": "mnist1d",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "onnxscript": "onnx",
    "matplotlib": "plot",
    "flwr": "flower",
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra."""


def explain(exc: ImportError) -> str | None:
    """The message for an optional package's `ImportError` (None: not one of ours)."""
    if isinstance(exc, MissingExtra):
        return str(exc)
    top = (exc.name or "").split(".")[0]
    if top not in EXTRAS:
        return None
    return f"this command needs the Python package {top!r}, which is not installed: " \
        f"pip install \"fedring[{EXTRAS[top]}]\""


def require(module: str, needed_for: str) -> ModuleType:
    """Import `module` (e.g. ``"sklearn.datasets"``) or raise `MissingExtra`
    saying that `needed_for` needs it and which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there; something it imports is broken
        extra = EXTRAS.get(top, top)
        raise MissingExtra(
            f"{needed_for} needs the Python package {top!r}, which is not installed: "
            f"pip install \"fedring[{extra}]\""
        ) from None

"""Export the trained model to ONNX and prove the file computes what torch computes.

`export_onnx` is what the coordinator (and `fedring simulate --out`) calls at the
end of a run, and what `fedring export onnx CHECKPOINT --out FILE` calls on a
saved checkpoint:

1. `torch.onnx.export` (the dynamo exporter of torch 2.x, via onnxscript) with a
   dynamic batch dimension, weights inside the file unless they pass 1 GiB;
2. ``onnx.checker.check_model(path, full_check=True)`` (shape inference included);
3. ONNX Runtime on `check_inputs` seeded random inputs against torch's outputs:
   the largest absolute difference must stay within `atol` (1e-4);
4. optionally int8 dynamic quantization (``onnxruntime.quantization``) with the
   test accuracy of the fp32 and int8 files side by side, when a test set is given.

Evaluation on a board goes through `fedring.onnx_model` (ONNX Runtime only).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from fedring.onnx_model import OnnxModel

log = logging.getLogger(__name__)

ATOL = 1e-4
EXTERNAL_DATA_BYTES = 1 << 30  # protobuf's limit is 2 GiB; keep well below it


class ExportError(RuntimeError):
    """The export ran but the file fails the checker or differs from torch."""


def export_onnx(
    model: nn.Module,
    feature_shape: tuple[int, ...],
    path: Path,
    *,
    check_inputs: int = 100,
    seed: int = 0,
    atol: float = ATOL,
    int8: bool = False,
    test_set: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Export `model` to `path`, check it, and compare ONNX Runtime with torch.

    Parameters
    ----------
    model : nn.Module
        The trained model; it is put in eval mode (and left there).
    feature_shape : tuple of int
        One example's shape without the batch dimension, e.g. ``(1, 8, 8)``.
    path : Path
        Output file; its folder is created. With `int8`, the quantized model is
        written beside it as ``<stem>.int8.onnx``.
    check_inputs : int
        Seeded random inputs (normal, from `seed`) fed to both runtimes.
    atol : float
        Largest allowed absolute difference of any logit.
    int8 : bool
        Also write an int8 dynamically quantized copy.
    test_set : (x, y) arrays, optional
        When given, the report holds the accuracy of torch, the ONNX file, and the
        int8 file on it.

    Returns
    -------
    dict
        ``path, opset, checker_ok, inputs_checked, max_abs_diff, atol, parity_ok,
        bytes``, then ``accuracy_torch, accuracy_onnx`` with a test set, and
        ``int8: {path, bytes, max_abs_diff, accuracy}`` with `int8`.

    Raises
    ------
    ExportError
        The checker refused the file, or ONNX Runtime differs from torch by more
        than `atol`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.eval()
    x = _inputs(feature_shape, check_inputs, seed)
    try:
        _export(model, x, path)
    except Exception as exc:  # the exporter's own errors: an op it cannot express, ...
        raise ExportError(f"{path}: torch.onnx.export failed: {exc}") from exc
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # ValidationError, and shape inference's InferenceError
        raise ExportError(f"{path}: onnx.checker refused the export: {exc}") from exc
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    try:
        runtime = OnnxModel.load(path)
        got = runtime.predict(x)
    except Exception as exc:  # ORT could not load or run the file
        raise ExportError(f"{path}: ONNX Runtime could not run the export: {exc}") from exc
    diff = float(np.abs(got - want).max())
    report: dict[str, Any] = {
        "path": str(path), "opset": _opset(path), "checker_ok": True,
        "inputs_checked": len(x), "max_abs_diff": diff, "atol": atol,
        "parity_ok": diff <= atol, "bytes": _size(path),
    }  # fmt: skip
    if not diff <= atol:  # also catches NaN
        raise ExportError(f"{path}: ONNX Runtime differs from torch by {diff:.3g} > atol {atol}")
    if test_set is not None:
        tx, ty = test_set
        with torch.no_grad():
            logits = model(torch.from_numpy(np.asarray(tx, dtype=np.float32))).numpy()
        report["accuracy_torch"] = float((logits.argmax(axis=1) == ty).mean())
        report["accuracy_onnx"] = runtime.accuracy(tx, ty)
    if int8:
        try:
            report["int8"] = _quantize(path, x, want, test_set)
        except Exception as exc:
            raise ExportError(f"{path}: int8 quantization failed: {exc}") from exc
    return report


def export_from_checkpoint(checkpoint: Path, out: Path, *, int8: bool = False) -> dict[str, Any]:
    """Rebuild the checkpoint's model with its parameters and run `export_onnx` on it."""
    from fedring import build
    from fedring.config import JobSpec
    from fedring.coordinator.checkpoint import Checkpoint, CheckpointError
    from fedring.training.models import set_flat_params

    ck = Checkpoint.load(checkpoint)
    spec = JobSpec.from_mapping(ck.spec)
    task = build.task_of(spec)  # the coordinator's own job: its task module is allowed
    ds = task.dataset(spec.seed)
    model = task.model(ds, spec.seed)
    if ck.params is None:
        raise CheckpointError(f"{checkpoint}: no round has completed yet; nothing to export")
    set_flat_params(model, ck.params)
    test = (ds.x_test.numpy(), ds.y_test.numpy()) if ds.num_classes else None  # accuracy
    report = export_onnx(model, ds.feature_shape, out, int8=int8, test_set=test, seed=spec.seed)
    report["checkpoint_round"] = ck.round
    return report


def _inputs(feature_shape: tuple[int, ...], n: int, seed: int) -> np.ndarray:
    if n < 1:
        raise ValueError(f"check_inputs={n} must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *feature_shape), generator=gen).numpy()


def _export(model: nn.Module, x: np.ndarray, path: Path) -> None:
    sample = torch.from_numpy(x[:2])  # two rows: a batch of one is specialised to 1
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    batch = torch.export.Dim("batch", min=1)
    with warnings.catch_warnings(), _quiet("torch.onnx", "onnxscript"):
        warnings.simplefilter("ignore")  # the exporter's deprecation chatter
        torch.onnx.export(
            model, (sample,), str(path), input_names=["x"], output_names=["logits"],
            dynamo=True, dynamic_shapes=({0: batch},), verbose=False,
            external_data=weights > EXTERNAL_DATA_BYTES,
        )  # fmt: skip


class _quiet:
    """Raise the named loggers to ERROR for the duration (the exporter prints progress)."""

    def __init__(self, *names: str) -> None:
        self.loggers = [logging.getLogger(n) for n in names]
        self.levels = [lg.level for lg in self.loggers]

    def __enter__(self) -> None:
        for lg in self.loggers:
            lg.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        for lg, level in zip(self.loggers, self.levels, strict=True):
            lg.setLevel(level)


def _quantize(
    path: Path, x: np.ndarray, want: np.ndarray, test_set: tuple[np.ndarray, np.ndarray] | None
) -> dict[str, Any]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = path.with_name(f"{path.stem}.int8.onnx")
    # The quantizer re-runs shape inference and trips on some value_info entries the
    # dynamo exporter writes (a transposed weight's shape); it re-infers them anyway.
    plain = onnx.load(str(path))
    del plain.graph.value_info[:]
    tmp = path.with_name(f".{path.stem}.plain.onnx")
    onnx.save(plain, str(tmp))
    try:
        quantize_dynamic(str(tmp), str(out), weight_type=QuantType.QInt8)
    finally:
        tmp.unlink(missing_ok=True)
    runtime = OnnxModel.load(out)
    got = runtime.predict(x)
    result: dict[str, Any] = {
        "path": str(out),
        "bytes": _size(out),
        "max_abs_diff": float(np.abs(got - want).max()),
        "argmax_agreement": float((got.argmax(axis=1) == want.argmax(axis=1)).mean()),
    }
    if test_set is not None:
        result["accuracy"] = runtime.accuracy(*test_set)
    return result


def _opset(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def _size(path: Path) -> int:
    """Bytes of the file plus any external-data files beside it."""
    extra = set(path.parent.glob(f"{path.name}.data"))
    return path.stat().st_size + sum(p.stat().st_size for p in extra)

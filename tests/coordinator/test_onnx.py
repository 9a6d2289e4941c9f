"""ONNX export: checker, parity with torch, int8, external data, torch-free evaluation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from fedring.cli import app
from fedring.config import JobSpec
from fedring.coordinator.checkpoint import Checkpoint
from fedring.coordinator.onnx_export import ExportError, export_onnx
from fedring.onnx_model import OnnxModel, OnnxModelError
from fedring.training.datasets import load_dataset
from fedring.training.models import build_model, flat_params

runner = CliRunner()


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    ds = load_dataset("digits", 0)
    return ds.x_test.numpy(), ds.y_test.numpy()


@pytest.mark.parametrize(("spec", "shape"), [("cnn", (1, 8, 8)), ("cnn", (1, 40))])
def test_export_matches_torch_on_100_inputs(tmp_path: Path, spec: str, shape: tuple) -> None:
    model = build_model(spec, shape, 10, seed=3)
    r = export_onnx(model, shape, tmp_path / "m.onnx")
    assert r["checker_ok"] and r["parity_ok"] and r["inputs_checked"] == 100
    assert r["max_abs_diff"] <= 1e-4 and r["opset"] >= 17
    assert r["bytes"] == (tmp_path / "m.onnx").stat().st_size
    # the dynamic batch dimension really is dynamic
    x = np.random.default_rng(0).normal(size=(7, *shape)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    got = OnnxModel.load(tmp_path / "m.onnx").predict(x)
    assert got.shape == (7, 10) and np.abs(got - want).max() <= 1e-4


def test_parity_failure_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = OnnxModel.predict
    monkeypatch.setattr(OnnxModel, "predict", lambda self, x: real(self, x) + 2e-4)
    with pytest.raises(ExportError, match="differs from torch"):
        export_onnx(build_model("mlp", (1, 8, 8), 10, seed=0), (1, 8, 8), tmp_path / "m.onnx")


def test_int8_reports_accuracy_beside_fp32(tmp_path: Path, digits: tuple) -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    _fit(model, *digits)
    r = export_onnx(model, (1, 8, 8), tmp_path / "m.onnx", int8=True, test_set=digits)
    assert r["accuracy_onnx"] == r["accuracy_torch"] > 0.8
    q = r["int8"]
    assert Path(q["path"]).exists() and q["bytes"] < r["bytes"] / 2
    assert abs(q["accuracy"] - r["accuracy_onnx"]) < 0.05
    assert q["max_abs_diff"] > 0  # int8 is not bit-exact; this is what the report is for


def _fit(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> None:
    """A few full-batch Adam steps on the test set: enough for accuracy to mean something."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(60):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()


def _external_model(folder: Path, location: str) -> Path:
    """y = x @ W with W stored as external data at `location` (relative to `folder`)."""
    w = numpy_helper.from_array(np.eye(3, dtype=np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])], [w],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / "ext.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="w.bin",
                    size_threshold=0)  # fmt: skip
    if location != "w.bin":
        m = onnx.load(str(path), load_external_data=False)
        for entry in m.graph.initializer[0].external_data:
            if entry.key == "location":
                entry.value = location
        onnx.save_model(m, str(path))
    return path


def test_external_data_inside_the_folder_loads(tmp_path: Path) -> None:
    m = OnnxModel.load(_external_model(tmp_path, "w.bin"))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(m.predict(x), x)


@pytest.mark.parametrize("location", ["../w.bin", "/etc/hostname", "sub/../../w.bin"])
def test_external_data_outside_the_folder_is_refused(tmp_path: Path, location: str) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    path = _external_model(folder, location)
    with pytest.raises(OnnxModelError, match="outside the model's folder") as info:
        OnnxModel.load(path)
    assert repr(location) in str(info.value)


def test_symlink_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(np.eye(3, dtype=np.float32).tobytes())
    path = _external_model(folder, "link.bin")
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(OnnxModelError, match=r"link\.bin"):
        OnnxModel.load(path)


def test_evaluation_with_onnxruntime_alone_never_imports_torch(
    tmp_path: Path, digits: tuple
) -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=1)
    r = export_onnx(model, (1, 8, 8), tmp_path / "m.onnx", test_set=digits)
    np.savez(tmp_path / "test.npz", x_test=digits[0], y_test=digits[1])
    out = subprocess.run(
        [sys.executable, "-m", "fedring.onnx_model", str(tmp_path / "m.onnx"),
         str(tmp_path / "test.npz")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout)
    assert got["torch_imported"] is False
    assert got["accuracy"] == r["accuracy_torch"] and got["n"] == len(digits[1])


def test_cli_exports_a_coordinator_checkpoint(tmp_path: Path, digits: tuple) -> None:
    spec = JobSpec(agents=2, model="mlp", dataset="digits", seed=5)
    model = build_model("mlp", (1, 8, 8), 10, seed=5)
    _fit(model, *digits)
    Checkpoint(job="j", key=b"k" * 32, spec=spec.resolved(), shards={"a": 0, "b": 1},
               model_sha256="0" * 64, shard_manifest={}, epoch=0, round=7,
               params=flat_params(model)).save(tmp_path)  # fmt: skip
    result = runner.invoke(
        app,
        [
            "export",
            "onnx",
            str(tmp_path / "checkpoint.pt"),
            "--out",
            str(tmp_path / "o" / "m.onnx"),
            "--int8",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["parity_ok"] and r["checkpoint_round"] == 7 and r["accuracy_onnx"] > 0.8
    assert Path(r["int8"]["path"]).exists()


def test_cli_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"not a checkpoint")
    result = runner.invoke(app, ["export", "onnx", str(tmp_path / "model.bin"), "--out", "x.onnx"])
    assert result.exit_code == 2 and "CHECKPOINT" in result.output
    result = runner.invoke(app, ["export", "onnx", str(tmp_path), "--out", "x.onnx"])
    assert result.exit_code == 2 and "no checkpoint" in result.output


def test_an_exporter_failure_is_an_export_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever torch.onnx.export raises (an op it cannot express, say) is reported as
    an `ExportError` naming the file, which runs catch and report instead of crashing."""
    from fedring.coordinator import onnx_export

    def broken(*_: object) -> None:
        raise RuntimeError("unsupported operator aten::weird")

    monkeypatch.setattr(onnx_export, "_export", broken)
    model = build_model("mlp", (64,), 10, seed=0)
    with pytest.raises(ExportError, match=r"model\.onnx: torch\.onnx\.export failed.*weird"):
        export_onnx(model, (64,), tmp_path / "model.onnx")


def test_a_sparse_initializer_pointing_outside_the_folder_is_refused(tmp_path: Path) -> None:
    from fedring.onnx_model import external_data_paths

    values = numpy_helper.from_array(np.ones(2, dtype=np.float32), "w_values")
    values.data_location = TensorProto.EXTERNAL
    values.ClearField("raw_data")
    values.external_data.add(key="location", value="../stolen.bin")
    indices = numpy_helper.from_array(np.array([0, 4], dtype=np.int64), "w_indices")
    sparse = helper.make_sparse_tensor(values, indices, [6])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        sparse_initializer=[sparse],
    )  # fmt: skip
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "model.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    assert external_data_paths(path) == ["../stolen.bin"]
    with pytest.raises(OnnxModelError, match=r"'\.\./stolen\.bin' is outside"):
        OnnxModel.load(path)

"""Run an exported model with ONNX Runtime alone: no torch on the board.

`import torch` costs a board ~220 MB of RSS and ~2 s; `import onnxruntime` ~45 MB
and ~0.2 s. An agent that only evaluates (or serves) the trained model therefore
uses this module, which imports numpy, onnx and onnxruntime and never torch
(a test checks ``'torch' not in sys.modules`` in a fresh interpreter).

Before a session is created, every tensor stored as external data must live in
the model's own folder: a `location` that is absolute or climbs out with ``..``
(or through a symlink) would let a crafted model file read any file on the board.

    python -m fedring.onnx_model model.onnx data.npz   # prints accuracy as JSON
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import uses_external_data


class OnnxModelError(ValueError):
    """An ONNX file that is missing, malformed, or points outside its folder."""


def external_data_paths(path: Path) -> list[str]:
    """The `location` of every external-data tensor in `path` (the graph only is read)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except FileNotFoundError:
        raise OnnxModelError(f"onnx model {str(path)!r} does not exist") from None
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise OnnxModelError(f"onnx model {str(path)!r} is not a valid ONNX file: {exc}") from None
    locations = []
    for tensor in _all_tensors(model.graph, model.functions):
        if uses_external_data(tensor):
            info = {e.key: e.value for e in tensor.external_data}
            locations.append(info.get("location", ""))
    return locations


def _sparse(sparse: onnx.SparseTensorProto) -> list[onnx.TensorProto]:
    return [sparse.values, sparse.indices]


def _node_tensors(nodes: Iterable[onnx.NodeProto]) -> list[onnx.TensorProto]:
    tensors: list[onnx.TensorProto] = []
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                tensors.append(attr.t)
            tensors.extend(attr.tensors)
            if attr.HasField("sparse_tensor"):
                tensors.extend(_sparse(attr.sparse_tensor))
            for sparse in attr.sparse_tensors:
                tensors.extend(_sparse(sparse))
            for sub in [attr.g, *attr.graphs] if attr.HasField("g") else attr.graphs:
                tensors.extend(_all_tensors(sub))
    return tensors


def _all_tensors(
    graph: onnx.GraphProto, functions: Iterable[onnx.FunctionProto] = ()
) -> list[onnx.TensorProto]:
    """Every tensor that may carry external data: initializers (dense and sparse),
    node attributes, subgraphs, and the nodes of the model's local functions."""
    tensors = list(graph.initializer)
    for sparse in graph.sparse_initializer:
        tensors.extend(_sparse(sparse))
    tensors.extend(_node_tensors(graph.node))
    for function in functions:
        tensors.extend(_node_tensors(function.node))
    return tensors


def check_external_data(path: Path) -> None:
    """Refuse a model whose external data lies outside its own folder.

    Raises
    ------
    OnnxModelError
        Naming the tensor location and the folder it must stay in.
    """
    folder = path.resolve().parent
    for location in external_data_paths(path):
        target = (folder / location).resolve()
        if not location or Path(location).is_absolute() or not target.is_relative_to(folder):
            raise OnnxModelError(
                f"onnx model {str(path)!r}: external data location {location!r} is outside "
                f"the model's folder {str(folder)!r}; refusing to load it"
            )


@dataclass
class OnnxModel:
    """An ONNX Runtime session over one checked model file."""

    path: Path
    session: ort.InferenceSession

    @classmethod
    def load(cls, path: Path, providers: list[str] | None = None, threads: int = 0) -> OnnxModel:
        """Check external data, then open a session (CPU unless `providers` says otherwise)."""
        path = Path(path)
        check_external_data(path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # 0: ONNX Runtime's default
        available = set(ort.get_available_providers())
        wanted = [p for p in (providers or ["CPUExecutionProvider"]) if p in available]
        try:
            session = ort.InferenceSession(
                str(path), options, providers=wanted or ["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            why = f"onnx model {str(path)!r}: ONNX Runtime refused it: {exc}"
            raise OnnxModelError(why) from None
        return cls(path, session)

    @property
    def input_name(self) -> str:
        return str(self.session.get_inputs()[0].name)

    def predict(self, x: np.ndarray, batch: int = 512) -> np.ndarray:
        """Logits for float32 features `x` of shape [n, *feature_shape]."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        outs = [
            self.session.run(None, {self.input_name: x[i : i + batch]})[0]
            for i in range(0, len(x), batch)
        ]
        return np.concatenate(outs) if outs else np.zeros((0,), dtype=np.float32)

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        """Fraction of `x` whose arg-max logit equals the label in `y`."""
        if len(x) == 0:
            raise OnnxModelError("accuracy of an empty test set is undefined")
        return float((self.predict(x).argmax(axis=1) == np.asarray(y)).mean())


def _main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m fedring.onnx_model MODEL.onnx DATA.npz (x_test, y_test)")
        return 2
    model = OnnxModel.load(Path(argv[0]))
    with np.load(argv[1], allow_pickle=False) as data:  # no pickle on data paths
        x, y = data["x_test"], data["y_test"]
    out: dict[str, Any] = {"accuracy": model.accuracy(x, y), "n": len(y)}
    out["torch_imported"] = "torch" in sys.modules
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

"""Evaluating the trained model on a board: ONNX Runtime alone beside torch.

For each model the same weights are exported once (`export_onnx`, parity-checked),
then two fresh interpreters evaluate the test set `--repeats` times:
- torch: ``import torch``, build the model, ``model(x)`` under ``no_grad`` (1 thread);
- ONNX Runtime: ``fedring.onnx_model.OnnxModel`` (1 thread), torch never imported.
Each prints its import time, median latency of one pass over the test set and one
batch of 1, and its peak RSS (``VmHWM``, the whole process: runtime + model + data).

    python bench/onnx_eval.py [--repeats 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

MODELS = (("mlp", "digits"), ("cnn", "digits"), ("cnn", "mnist1d"))

# Shared by both child scripts; they import json, re, statistics, sys and time first.
COMMON = """
def peak_rss_mb():
    # VmHWM is this image's own high-water mark; ru_maxrss would carry the forked
    # parent's (this benchmark, with torch loaded) across exec.
    status = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) / 1024
def median_seconds(call, batch, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call(batch)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
def report(imported, call, x, repeats):
    full, one = median_seconds(call, x, repeats), median_seconds(call, x[:1], repeats)
    print(json.dumps({"import_s": imported, "full_ms": full * 1e3, "one_ms": one * 1e3,
                      "peak_rss_mb": peak_rss_mb(), "torch_imported": "torch" in sys.modules}))
"""

TORCH = (
    COMMON
    + """
import json, re, statistics, sys, time
t0 = time.perf_counter()
import numpy as np, torch
from fedring.training.models import build_model
imported = time.perf_counter() - t0
torch.set_num_threads(1)
spec, shape, path = sys.argv[1], tuple(json.loads(sys.argv[2])), sys.argv[3]
repeats = int(sys.argv[4])
x = torch.from_numpy(np.load(path)["x_test"])
model = build_model(spec, shape, 10, seed=0).eval()
def call(batch):
    with torch.no_grad():
        return model(batch).argmax(1)
report(imported, call, x, repeats)
"""
)

ORT = (
    COMMON
    + """
import json, re, statistics, sys, time
t0 = time.perf_counter()
import numpy as np
from fedring.onnx_model import OnnxModel
imported = time.perf_counter() - t0
model_path, path, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
x = np.load(path)["x_test"]
model = OnnxModel.load(model_path, threads=1)
report(imported, lambda batch: model.predict(batch).argmax(1), x, repeats)
"""
)


def _child(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(repeats: int) -> list[dict[str, Any]]:
    from fedring.coordinator.onnx_export import export_onnx
    from fedring.training.datasets import load_dataset
    from fedring.training.models import build_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec, data in MODELS:
            ds = load_dataset(data, 0)
            shape = ds.feature_shape
            npz = Path(tmp) / f"{data}.npz"
            np.savez(npz, x_test=ds.x_test.numpy())
            onnx_path = Path(tmp) / f"{spec}-{data}.onnx"
            report = export_onnx(build_model(spec, shape, 10, seed=0), shape, onnx_path)
            t = _child(TORCH, spec, json.dumps(shape), str(npz), str(repeats))
            o = _child(ORT, str(onnx_path), str(npz), str(repeats))
            rows.append({"model": f"{spec} {data}", "test_rows": len(ds.x_test),
                         "parity_max_abs_diff": report["max_abs_diff"], "torch": t,
                         "onnxruntime": o})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.repeats)
    if args.json:
        print(json.dumps(rows, sort_keys=True))
        return
    print("evaluation in a fresh process, 1 thread: torch | ONNX Runtime (torch not imported)")
    print(f"{'model':14} {'rows':>5} {'import s':>15} {'test set ms':>17} {'batch 1 ms':>15} "
          f"{'peak RSS MB':>15}")  # fmt: skip
    for r in rows:
        t, o = r["torch"], r["onnxruntime"]
        if o["torch_imported"]:
            raise SystemExit("the ONNX Runtime process imported torch")
        print(f"{r['model']:14} {r['test_rows']:>5} {t['import_s']:>7.2f} | {o['import_s']:<5.2f} "
              f"{t['full_ms']:>8.2f} | {o['full_ms']:<6.2f} "
              f"{t['one_ms']:>6.3f} | {o['one_ms']:<6.3f} "
              f"{t['peak_rss_mb']:>7.0f} | {o['peak_rss_mb']:<5.0f}")  # fmt: skip


if __name__ == "__main__":
    main()

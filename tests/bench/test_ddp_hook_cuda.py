"""bench/ddp_hook_cuda.py with --device cpu: the script the GPU run uses, on gloo here, so
that it is known to run before anyone spends GPU time on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_script_runs_on_the_cpu_and_ends_with_one_json_line(tmp_path: Path) -> None:
    argv = [sys.executable, str(ROOT / "bench" / "ddp_hook_cuda.py"), "--device", "cpu",
            "--steps", "14", "--parity-steps", "4", "--hidden", "32"]  # fmt: skip
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["backend"] == "gloo" and report["card"] == "cpu"
    world2 = report["world2"]
    assert isinstance(world2, dict), f"the 2-rank run gave no result: {world2}"  # its why
    # density 1.0 with fp32 values is plain all-reduce's arithmetic: 2 ranks, a + b, / 2
    assert world2["parity_max_abs_diff_fp32"] == 0.0
    assert world2["parity_max_abs_diff_bf16"] == 0.0
    for dtype in ("fp32", "bf16"):
        run = world2[f"train_{dtype}"]
        assert (
            run["hook_final_loss"] < run["first_loss"] and run["ddp_final_loss"] < run["first_loss"]
        )
        assert run["bytes_ratio"] > 1.0 and run["nonfinite_buckets"] == 0

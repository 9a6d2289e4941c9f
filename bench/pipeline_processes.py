"""A model no Pi 3 holds, trained by 3 processes (one stage each) over a real Mosquitto,
beside the same model trained in one process: peak RSS per process against the rpi3
budget, accuracy, bytes per stage and wall time, from one run.

- pipeline: ``python -m fedring.pipeline_worker`` x 3 (S = 3, D = 1), each process
  building only its own stage's layers, activations and gradients as fp32 frames
  through the broker, M = 4 micro-batches, 1F1B;
- one process: the same worker with ``--stages 1 --micro-batches 1``: the whole model,
  the same initial weights (per-layer seeds), batches, optimizer and steps, plain
  full-batch SGD. It still connects to the broker (and sends nothing).

Peak RSS is each process's VmHWM, PyTorch's runtime (~250 MB here) included; the
budget is the board profile's ``ram_budget_mb``. "does not fit" is the data-parallel
estimate of `fedring simulate` (24 fp32 copies of the parameters). Data: digits,
written once to an npz file (the workers load it without scikit-learn, ~90 MB).

    python bench/pipeline_processes.py [--steps 300] [--model mlp:2048x2048x2048x2048]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedring.firmware_profiles.schema import load_builtin
from fedring.pipeline_worker import assembled_from, parser
from fedring.training.datasets import load_dataset
from fedring.transport.mosquitto import Mosquitto

DP_COPIES = 24  # fp32 copies per parameter in the data-parallel memory check


def digits_npz(path: Path, seed: int) -> str:
    d = load_dataset("digits", seed=seed)
    np.savez(path, x=d.x_train.numpy(), y=d.y_train.numpy(), x_test=d.x_test.numpy(),
             y_test=d.y_test.numpy())  # fmt: skip
    return f"npz:{path}"


def launch(url: str, job: str, stages: int, common: list[str], out: Path,
           timeout: float) -> tuple[list[dict[str, Any]], float]:  # fmt: skip
    """`stages` worker processes; their JSON summaries and the wall time of the slowest."""
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fedring.pipeline_worker", "--broker", url, "--job", job,
             "--stages", str(stages), "--stage", str(i), "--out", str(out), *common],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        for i in range(stages)
    ]  # fmt: skip
    results = []
    for i, p in enumerate(procs):
        so, se = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise SystemExit(f"stage {i} exited {p.returncode}: {se.decode()[-2000:]}")
        results.append(json.loads(so.decode().strip().splitlines()[-1]))
    return results, time.perf_counter() - start


def accuracy(out: Path, argv: list[str]) -> float:
    args = parser().parse_args(argv)
    model = assembled_from(out, args).eval()
    data = load_dataset(args.dataset, seed=args.seed)
    with torch.no_grad():
        return float((model(data.x_test).argmax(1) == data.y_test).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", default="mlp:2048x2048x2048x2048")
    ap.add_argument("--board", default="rpi3")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedring-pp-"))
    dataset = digits_npz(tmp / "digits.npz", a.seed)
    common = ["--model", a.model, "--dataset", dataset, "--board", a.board,
              "--steps", str(a.steps), "--lr", str(a.lr), "--seed", str(a.seed),
              "--timeout-s", "60"]  # fmt: skip
    base = ["--broker", "x", "--job", "x", "--stage", "0", *common]
    with Mosquitto(workdir=tmp / "broker") as broker:
        pipe, pipe_s = launch(broker.url, "pp3", 3, common, tmp / "pp3", 1200)
        alone, alone_s = launch(broker.url, "pp1", 1, [*common, "--micro-batches", "1"],
                                tmp / "pp1", 1200)  # fmt: skip
    acc_pipe = accuracy(tmp / "pp3", [*base, "--stages", "3"])
    acc_alone = accuracy(tmp / "pp1", [*base, "--stages", "1", "--micro-batches", "1"])
    budget = load_builtin(a.board).ram_budget_mb
    params = alone[0]["params"]
    need = params * 4 * DP_COPIES / 2**20
    rows = {"model": a.model, "params": params, "board": a.board, "budget_mb": budget,
            "data_parallel_estimate_mb": round(need, 1), "steps": a.steps,
            "pipeline": pipe, "pipeline_wall_s": round(pipe_s, 1),
            "pipeline_accuracy": acc_pipe, "one_process": alone[0],
            "one_process_wall_s": round(alone_s, 1), "one_process_accuracy": acc_alone}  # fmt: skip
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"{a.model}: {params:,} params; data-parallel estimate {need:.0f} MB = "
        f"{need / budget:.1f}x the {a.board} budget of {budget} MB; {a.steps} steps, digits"
    )
    print(f"{'process':<22}{'layers':>8}{'params':>12}{'peak RSS MB':>13}{'budget':>8}"
          f"{'bytes sent':>13}{'train s':>9}{'wall s':>8}")  # fmt: skip
    for r in [*pipe, {**alone[0], "stage": "one process"}]:
        name = f"stage {r['stage']}" if isinstance(r["stage"], int) else r["stage"]
        print(f"{name:<22}{r['layers'][0]:>4}..{r['layers'][1]:<2}{r['params']:>12,}"
              f"{r['peak_rss_mb']:>13.1f}{r['budget_mb']:>8}{r['bytes_sent']:>13,}"
              f"{r['train_seconds']:>9.1f}{r['wall_seconds']:>8.1f}")  # fmt: skip
    print(
        f"accuracy: pipeline {acc_pipe:.4f}, one process {acc_alone:.4f} "
        f"({(acc_pipe - acc_alone) * 100:+.2f} pp); wall: pipeline {pipe_s:.1f} s, "
        f"one process {alone_s:.1f} s (3 processes share this host's 2 cores)"
    )


if __name__ == "__main__":
    main()

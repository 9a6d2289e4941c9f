"""Checkpoint and resume per stage: every grid worker (one board) saves its own stage.

A worker's state is its stage's parameters and buffers, its optimizer's state, its
reducer's error-feedback residual (each replica keeps its own), its batch sampler's
state when its batches come from a `ShardBatches`, and the step it reached: plain
tensors, numbers and lists, so ``torch.load(..., weights_only=True)`` reads it back
(no pickle of code). `save_grid` writes one file per worker, each atomically (a
temporary file, then `os.replace`), so a crash leaves the previous checkpoint whole;
`load_grid` refuses files of another stage or replica, or a grid whose workers
stopped at different steps, naming the file.

    save_grid(grid, Path("ckpt"), step=100)
    grid = build_grid(...)                   # the same plan, on fresh boards
    start = load_grid(grid, Path("ckpt"))    # 100: run_steps(grid, start=start, ...)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fedring.pipeline.grid import GridWorker, ShardBatches, worker_name

VERSION = 1


class CheckpointMismatch(ValueError):
    """A checkpoint that does not belong to this worker or grid."""


def worker_state(w: GridWorker, step: int) -> dict[str, Any]:
    """What worker `w` needs to go on from `step` bit for bit."""
    state: dict[str, Any] = {
        "version": VERSION,
        "stage": w.stage.index,
        "replica": w.replica,
        "step": step,
        "model": {k: v.detach().clone() for k, v in w.stage.module.state_dict().items()},
        "optimizer": w.optimizer.state_dict() if w.optimizer is not None else {},
        "reducer": w.reducer.state_dict() if w.reducer is not None else {},
    }
    if isinstance(w.next_batch, ShardBatches):
        state["sampler"] = w.next_batch.sampler.state_dict()
    return state


def load_worker_state(w: GridWorker, state: dict[str, Any], where: str = "state") -> int:
    """Load `state` into `w`; return the step to go on from."""
    want = (VERSION, w.stage.index, w.replica)
    got = (state.get("version"), state.get("stage"), state.get("replica"))
    if got != want:
        raise CheckpointMismatch(f"{where}: (version, stage, replica) = {got}, this worker is "
                                 f"{want}")  # fmt: skip
    w.stage.module.load_state_dict(state["model"])
    if w.optimizer is not None:
        w.optimizer.load_state_dict(state["optimizer"])
    if w.reducer is not None:
        w.reducer.load_state_dict(state["reducer"])
    if isinstance(w.next_batch, ShardBatches) and "sampler" in state:
        w.next_batch.sampler.load_state_dict(state["sampler"])
    return int(state["step"])


def save_grid(grid: list[list[GridWorker]], out: Path, step: int) -> list[Path]:
    """One file per worker under `out`, ``stage{s}-r{d}.pt``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for w in (w for row in grid for w in row):
        path = out / f"{worker_name(w.stage.index, w.replica)}.pt"
        tmp = path.with_suffix(".pt.tmp")
        with open(tmp, "wb") as f:
            torch.save(worker_state(w, step), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        paths.append(path)
    return paths


def load_grid(grid: list[list[GridWorker]], out: Path) -> int:
    """Load every worker's file from `out`; return the step they all reached."""
    steps = set()
    for w in (w for row in grid for w in row):
        path = out / f"{worker_name(w.stage.index, w.replica)}.pt"
        if not path.is_file():
            raise CheckpointMismatch(f"no checkpoint {str(path)!r} for stage {w.stage.index} "
                                     f"replica {w.replica}")  # fmt: skip
        # weights_only: tensors, numbers and lists only; never code from a file
        state = torch.load(path, map_location="cpu", weights_only=True)
        steps.add(load_worker_state(w, state, str(path)))
    if len(steps) != 1:
        raise CheckpointMismatch(f"{str(out)!r}: workers stopped at different steps "
                                 f"{sorted(steps)}")  # fmt: skip
    return steps.pop()

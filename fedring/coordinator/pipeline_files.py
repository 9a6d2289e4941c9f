"""What a pipeline job leaves in the coordinator's ``--out`` folder.

- ``stages/stage{s}.pt`` and ``stages/step.json``: the last step for which *every*
  stage's upload arrived (hash-checked), each stage's flat state (parameters and
  buffers, then momentum) with its step; written atomically, the step file last, so
  a killed stage leaves the previous complete set on disk;
- ``stage{s}.pt`` (each stage's final ``state_dict``) and ``model.pt`` (the whole
  reassembled model's), ``model.onnx`` where the onnx extra is installed;
- ``metrics.jsonl`` (the last stage's loss rows) and ``summary.json``.

Every file is read back with ``torch.load(..., weights_only=True)``: tensors and
numbers only, never code.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedring.coordinator.outputs import guarded_export
from fedring.counters import Counters
from fedring.pipeline.assignment import load_stage_state
from fedring.pipeline.partition import StagePlan
from fedring.pipeline.schedule import timeline
from fedring.report import atomic_write

log = logging.getLogger(__name__)
STAGES = "stages"


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StageCheckpoints:
    """Uploads by step; a step's set goes to disk once all `count` stages sent theirs."""

    def __init__(self, out: Path, count: int) -> None:
        self.dir = out / STAGES
        self.count = count
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.step = -1  # the last complete step on disk
        self.latest: dict[int, torch.Tensor] = {}  # its states, by stage

    def add(self, stage: int, step: int, flat: torch.Tensor) -> bool:
        """Keep stage `stage`'s state at the start of `step`; True when that completes a set."""
        if step <= self.step:
            return False
        got = self.pending.setdefault(step, {})
        got[stage] = flat
        if len(got) < self.count:
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        for s, state in sorted(got.items()):
            _save({"stage": s, "step": step, "state": state}, self.dir / f"stage{s}.pt")
        atomic_write(self.dir / "step.json", json.dumps({"step": step, "stages": self.count}))
        self.step, self.latest = step, dict(got)
        self.pending = {k: v for k, v in self.pending.items() if k > step}
        return True


def load_stage_checkpoint(path: Path) -> tuple[int, int, torch.Tensor]:
    """(stage, step, flat state) of one ``stages/stage{s}.pt`` file."""
    doc = torch.load(path, map_location="cpu", weights_only=True)  # no code from a file
    return int(doc["stage"]), int(doc["step"]), doc["state"]


def reassemble(modules: Sequence[nn.Module], finals: Mapping[int, torch.Tensor]) -> nn.Sequential:
    """The whole model: each stage's layers (`modules[s]`) loaded with its final state."""
    layers: list[nn.Module] = []
    for s, module in enumerate(modules):
        load_stage_state(module, finals[s])
        layers.extend(module.children())
    return nn.Sequential(*layers)


def write_models(out: Path, modules: Sequence[nn.Module], model: nn.Module) -> None:
    for s, module in enumerate(modules):
        _save(module.state_dict(), out / f"stage{s}.pt")
    _save(model.state_dict(), out / "model.pt")


def export(model: nn.Module, feature_shape: tuple[int, ...], out: Path,
           counters: Counters) -> dict[str, Any]:  # fmt: skip
    """``out/model.onnx`` of the reassembled model, checked with ONNX Runtime; the
    report, or why not (`outputs.guarded_export`)."""

    def run() -> dict[str, Any]:
        from fedring.coordinator.onnx_export import export_onnx

        return export_onnx(model, feature_shape, out / "model.onnx")

    return guarded_export(run, counters)


def bubble(plan: StagePlan, docs: Mapping[int, Mapping[str, Any]]) -> float:
    """The schedule replayed with each stage's measured seconds per micro-batch."""
    fwd, bwd = [], []
    for s in range(len(plan.stages)):
        doc = docs[s]
        runs = max(int(doc.get("micro_run", 0)), 1)
        fwd.append(float(doc.get("forward_s", 0.0)) / runs)
        bwd.append(float(doc.get("backward_s", 0.0)) / runs)
    return timeline(plan.schedule, fwd, bwd, micro_batches=plan.micro_batches).bubble


def stage_rows(plan: StagePlan, members: Sequence[str], docs: Mapping[int, Mapping[str, Any]],
               runtime_mb: float) -> list[dict[str, Any]]:  # fmt: skip
    """Per stage: its agent, layers, the plan's estimate, peak RSS beside the budget
    (strict, and the agent's rule: budget + the runtime's allowance), bytes, seconds."""
    rows = []
    for spec in plan.stages:
        doc = docs[spec.index]
        rss = float(doc.get("peak_rss_mb", 0.0))
        rows.append({
            "stage": spec.index, "agent": members[spec.index], "board": spec.board,
            "layers": [spec.start, spec.end - 1], "params": spec.params,
            "estimate_mb": round(spec.memory_mb, 1), "budget_mb": spec.budget_mb,
            "peak_rss_mb": rss, "within_budget": rss <= spec.budget_mb,
            "within_budget_and_runtime": rss <= spec.budget_mb + runtime_mb,
            "bytes_sent": doc.get("bytes_sent", 0),
            "payload_bytes_sent": doc.get("payload_bytes", 0),
            "train_seconds": doc.get("train_seconds", 0.0), "sha256": doc.get("sha256", ""),
        })  # fmt: skip
    return rows

"""The coordinator's checkpoint: one file, written atomically after every round.

It holds what `--resume` needs to carry on: the job id and key, the spec, which
agent holds which shard, the epoch, the round and the parameters at its start, and
the job's history so far (re-formation events, wall seconds); the metrics rows are
appended to ``metrics.jsonl`` as they arrive.
Written with `torch.save` to a temporary file then `os.replace`d, so a crash
leaves the previous checkpoint intact; read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedring.training.models import flat_sha256

FILE = "checkpoint.pt"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or inconsistent."""


@dataclass
class Checkpoint:
    job: str
    key: bytes
    spec: dict[str, Any]
    shards: dict[str, int]  # agent id -> shard index
    model_sha256: str  # the initial model (what every agent verifies first)
    shard_manifest: dict[str, Any]
    epoch: int
    round: int  # parameters are the state at the start of this round
    params: torch.Tensor | None  # None until the first round completes
    task: dict[str, str] = field(default_factory=dict)  # TaskId: name, version, sha256
    events: list[dict[str, Any]] = field(default_factory=list)  # re-formations so far
    wall_s: float = 0.0  # seconds the job has run, over every coordinator process

    @property
    def params_sha256(self) -> str:
        return flat_sha256(self.params) if self.params is not None else ""

    def save(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path, tmp = out / FILE, out / f".{FILE}.tmp"
        state = {
            "job": self.job, "key": self.key.hex(), "spec": self.spec, "shards": self.shards,
            "model_sha256": self.model_sha256, "shard_manifest": self.shard_manifest,
            "epoch": self.epoch, "round": self.round,
            "params": self.params if self.params is not None else torch.empty(0),
            "params_sha256": self.params_sha256, "task": self.task,
            "events": self.events, "wall_s": self.wall_s,
        }  # fmt: skip
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # it holds the job key
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, out: Path) -> Checkpoint:
        path = out / FILE
        if not path.exists():
            raise CheckpointError(f"--resume: no checkpoint at {path}")
        try:
            state = torch.load(path, weights_only=True)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from exc
        except Exception as exc:  # the weights-only unpickler's refusal of anything else
            raise CheckpointError(  # its own message would advise weights_only=False: never
                f"checkpoint {path} is unreadable: not a fedring checkpoint "
                "(torch.load(weights_only=True) refused it)"
            ) from exc
        try:
            params = state["params"]
            ck = cls(
                job=str(state["job"]), key=bytes.fromhex(state["key"]), spec=dict(state["spec"]),
                shards={str(k): int(v) for k, v in state["shards"].items()},
                model_sha256=str(state["model_sha256"]),
                shard_manifest=dict(state["shard_manifest"]), epoch=int(state["epoch"]),
                round=int(state["round"]), params=params if params.numel() else None,
                task={str(k): str(v) for k, v in state.get("task", {}).items()},
                events=[dict(e) for e in state.get("events", [])],
                wall_s=float(state.get("wall_s", 0.0)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {path} is unreadable: {exc!r}") from exc
        if ck.params_sha256 != state.get("params_sha256", ""):
            raise CheckpointError(f"checkpoint {path}: parameters do not match their sha256")
        return ck

"""A job's first checkpoint, planned as the coordinator plans it: what the manifest
tests build their segments from."""

from __future__ import annotations

import os

import torch

from fedring.build import task_of
from fedring.config import JobSpec
from fedring.coordinator.checkpoint import Checkpoint
from fedring.engine.plan import plan


def first_checkpoint(spec: JobSpec, members: list[str]) -> Checkpoint:
    """Round 0 of `spec` for `members` (member i holds shard i), keyed at random."""
    p = plan(task_of(spec), agents=len(members), sharding="iid", seed=0)
    return Checkpoint(job="j", key=os.urandom(32), spec=spec.resolved(),
                      shard_manifest=p.manifest.to_dict(),
                      shards={m: i for i, m in enumerate(members)},
                      model_sha256=p.model_sha256, epoch=0, round=0,
                      params=torch.zeros(1))  # fmt: skip

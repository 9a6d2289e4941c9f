"""Plan and verify: what the coordinator decides before round 0, and what every member
checks before it trains.

The coordinating side (`plan`) loads the task's data, shards it, hashes every
shard, builds the initial model once and keeps its parameters; the manifest
carries a sha256 per shard and the initial parameters' sha256. A member
(`prepare`) verifies its shard and then starts from the initial parameters it
was *sent*, checked against that sha256 (SEEDS A: a full parameter
synchronisation at the start). Deriving the model locally from the seed instead
(`initial=None`) is allowed, but only works where every member's torch draws the
same random bits: He-normal init differs between x86_64 and aarch64, so a mixed
fleet must be sent its start.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedring.aggregation.rules import capped_weights
from fedring.engine.task import Source, Task, TaskId, task_id
from fedring.training.datasets import Dataset
from fedring.training.models import flat_params, flat_sha256, params_sha256, set_flat_params
from fedring.training.sharding import (
    ShardEntry,
    ShardManifest,
    build_manifest,
    make_shards,
    shard_data,
    verify_shard,
)


class ModelMismatch(ValueError):
    """A member's initial model does not hash to the manifest's."""


@dataclass
class Plan:
    """What the coordinator publishes before round 0."""

    task: Task
    task_id: TaskId
    dataset: Dataset
    manifest: ShardManifest
    shards: list[np.ndarray]
    initial: torch.Tensor  # flat float32 parameters every member starts from
    model_sha256: str
    weights: list[float]  # each member's share of the mean (1/N, or capped by shard size)


def plan(
    task: Task, *, agents: int, sharding: str = "iid", seed: int = 0,
    weight_cap: float | None = None, sources: Iterable[Source] = (),
) -> Plan:  # fmt: skip
    """Shard `task`'s data over `agents` and fix the initial model; with `weight_cap`,
    members are weighted by shard size, none above cap x its equal share. `sources`:
    the modules the task was loaded from, which its `TaskId` hashes (`engine.gate`)."""
    dataset = task.dataset(seed)
    shards = make_shards(dataset.y_train.numpy(), agents, sharding, seed)
    manifest = build_manifest(dataset, shards, sharding, seed)
    initial = flat_params(task.model(dataset, seed))
    if weight_cap is not None:
        weights = capped_weights(manifest.sizes, weight_cap).tolist()
    else:
        weights = [1.0 / agents] * agents
    return Plan(task, task_id(task, sources), dataset, manifest, shards, initial,
                flat_sha256(initial), weights)  # fmt: skip


def prepare(
    task: Task, dataset: Dataset, manifest: ShardManifest | ShardEntry, index: np.ndarray,
    rank: int, *,
    seed: int, model_sha256: str, initial: torch.Tensor | None,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Verify shard `rank` (the rows `index` of `dataset`) against the manifest (or
    the one entry of it the member was sent) and
    build the starting model: the `initial` parameters if sent, else derived locally.

    Raises `ShardError` for a wrong shard and `ModelMismatch` for a wrong start.
    """
    x, y = shard_data(dataset, index)
    verify_shard(manifest, rank, x, y)
    model = task.model(dataset, seed)
    if initial is not None:
        got = flat_sha256(initial)
        if got != model_sha256:
            raise ModelMismatch(
                f"member {rank}: initial parameters received hash to {got[:12]}..., the "
                f"manifest says {model_sha256[:12]}...; refusing a corrupted start"
            )
        set_flat_params(model, initial)
    elif (got := params_sha256(model)) != model_sha256:
        raise ModelMismatch(
            f"member {rank}: initial model sha256 {got[:12]}... != manifest "
            f"{model_sha256[:12]}...: this board's torch derives other initial values "
            "(architectures differ); let the coordinator send the initial model"
        )
    return model, x, y

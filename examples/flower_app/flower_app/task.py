"""The learning task: digits, a small MLP, H local steps of momentum SGD.

Any PyTorch task works; this one borrows fedring's digits loader, shards and MLP
so that the bench compares fedring's own ServerApp and this app on the same data,
the same initial model and the same local steps.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from fedring.engine.local import LocalWork
from fedring.engine.sampler import ShardSampler
from fedring.engine.task import ClassificationTask
from fedring.training.datasets import Dataset, load_dataset
from fedring.training.models import build_model
from fedring.training.sharding import make_shards, shard_data

SEED = 0


@lru_cache(maxsize=1)
def _digits() -> Dataset:
    return load_dataset("digits", SEED)


def model() -> nn.Module:
    ds = _digits()
    return build_model("mlp", ds.feature_shape, ds.num_classes, SEED)


def partition(pid: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ds = _digits()
    return shard_data(ds, make_shards(ds.y_train.numpy(), n, "iid", SEED)[pid])


def train(net: nn.Module, pid: int, n: int, steps: int, lr: float, server_round: int) -> float:
    """`steps` momentum-SGD steps on partition `pid`; returns the mean loss."""
    x, y = partition(pid, n)
    sampler = ShardSampler(len(x), batch_size=32, seed=server_round, rank=pid)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    losses = LocalWork(net, x, y, F.cross_entropy, sampler, opt).steps(steps, lr)
    return sum(losses) / len(losses)


def evaluate(net: nn.Module) -> tuple[float, float]:
    """Loss and accuracy on the held-out digits."""
    return ClassificationTask("digits", "mlp").evaluate(net, _digits())

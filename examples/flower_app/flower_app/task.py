"""The learning task: digits, a small MLP, H local steps of momentum SGD.

Any PyTorch task works; this one borrows fedring's digits loader, shards and MLP
so that the bench compares fedring's own ServerApp and this app on the same data,
the same initial model and the same local steps.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from fedring.training.datasets import Dataset, load_dataset
from fedring.training.models import build_model
from fedring.training.sharding import make_shards, shard_data
from fedring.training.trainer import LocalTrainer

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
    trainer = LocalTrainer(net, x, y, batch_size=32, momentum=0.9, seed=server_round, rank=pid)
    losses = []
    for _ in range(steps):
        loss, g = trainer.gradient()
        trainer.step(g, lr)
        losses.append(loss)
    return sum(losses) / len(losses)


def evaluate(net: nn.Module) -> tuple[float, float]:
    """Loss and accuracy on the held-out digits."""
    ds = _digits()
    trainer = LocalTrainer(net, ds.x_test, ds.y_test, batch_size=1, momentum=0.0, seed=0, rank=0)
    return trainer.evaluate(ds.x_test, ds.y_test)

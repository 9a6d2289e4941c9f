"""Seeded batches of one shard, with a state that survives a process restart.

`ShardSampler` is a batch sampler for `torch.utils.data.DataLoader`: an endless
stream of index batches of `batch_size`, from a permutation of the shard drawn
from a generator seeded by (seed, rank) and redrawn when the rest of the current
one cannot fill a batch. Its `state_dict` (generator state, permutation, position,
samples served) is plain tensors and ints, so a board that restarts, a Flower node
that runs each round in a fresh process, or a rollback continues with exactly the
batches it would have seen.

    >>> s = ShardSampler(5, batch_size=2, seed=0, rank=0)
    >>> it = iter(s); first = [next(it), next(it)]
    >>> t = ShardSampler(5, batch_size=2, seed=0, rank=0); t.load_state_dict(s.state_dict())
    >>> next(iter(t)) == next(it)
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


class ShardSampler:
    """Endless seeded batches of indices into a shard of `size` samples."""

    def __init__(self, size: int, *, batch_size: int, seed: int, rank: int = 0) -> None:
        if size < 1:
            raise ValueError(f"shard of rank {rank} is empty")
        self.size = size
        self.batch_size = min(batch_size, size)
        self.samples_seen = 0
        self._gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self._order = torch.empty(0, dtype=torch.int64)
        self._pos = 0

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices of a seeded shuffle, reshuffled each epoch."""
        if self._pos + self.batch_size > len(self._order):
            self._order = torch.randperm(self.size, generator=self._gen)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        self.samples_seen += len(idx)
        return idx.tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self._gen.get_state(),
            "order": self._order.clone(),
            "pos": self._pos,
            "samples_seen": self.samples_seen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        order = state["order"]
        if order.dtype != torch.int64 or (len(order) and int(order.max()) >= self.size):
            raise ValueError(f"sampler state: order does not index a shard of {self.size}")
        self._gen.set_state(state["rng"])
        self._order = order.clone()
        self._pos = int(state["pos"])
        self.samples_seen = int(state["samples_seen"])

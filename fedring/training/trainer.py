"""One agent's local training state: model, shard, seeded batches, SGD on flat vectors.

Everything the exchange touches is a flat float32 vector in `model.parameters()`
order (see `models.flat_params`), so compression and the ring never see layer
shapes. The optimizer is momentum SGD written out on those vectors, which keeps
every agent's update bit-identical when the aggregated gradient is identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedring.training.models import flat_grads, flat_params, set_flat_params


@dataclass
class Snapshot:
    """A known-good state to roll back to after divergence."""

    params: torch.Tensor
    velocity: torch.Tensor
    residual: torch.Tensor | None


class LocalTrainer:
    """Model, data shard and SGD state of one agent."""

    def __init__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        batch_size: int,
        momentum: float,
        seed: int,
        rank: int,
    ) -> None:
        if len(x) == 0:
            raise ValueError(f"agent {rank} has an empty shard")
        self.model = model
        self.x, self.y = x, y
        self.batch_size = min(batch_size, len(x))
        self.momentum = momentum
        self.velocity = torch.zeros_like(flat_params(model))
        self.samples_seen = 0
        self._gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self._order = torch.empty(0, dtype=torch.int64)
        self._pos = 0

    @property
    def params(self) -> torch.Tensor:
        return flat_params(self.model)

    def set_params(self, flat: torch.Tensor) -> None:
        set_flat_params(self.model, flat)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `batch_size` samples of a seeded shuffle, reshuffled each epoch."""
        if self._pos + self.batch_size > len(self._order):
            self._order = torch.randperm(len(self.x), generator=self._gen)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        self.samples_seen += len(idx)
        return self.x[idx], self.y[idx]

    def gradient(
        self,
        anchor: torch.Tensor | None = None,
        mu: float = 0.0,
        *,
        on_grad: Callable[[int], None] | None = None,
    ) -> tuple[float, torch.Tensor]:
        """Loss and flat gradient on the next batch.

        With `anchor` and `mu`, adds the correction ``mu * (params - anchor)`` that
        keeps local steps from drifting far from the last global model. During
        backward, ``on_grad(i)`` is called as soon as the gradient of parameter i
        (in `model.parameters()` order) is complete (see `training.overlap`).
        """
        xb, yb = self.next_batch()
        self.model.train()
        self.model.zero_grad(set_to_none=False)
        loss = F.cross_entropy(self.model(xb), yb)
        hooks = [] if on_grad is None else [
            p.register_post_accumulate_grad_hook(lambda _, i=i: on_grad(i))
            for i, p in enumerate(self.model.parameters()) if p.requires_grad
        ]  # fmt: skip
        try:
            loss.backward()
        finally:
            for hook in hooks:
                hook.remove()
        grad = flat_grads(self.model)
        if anchor is not None and mu:
            grad.add_(self.params - anchor, alpha=mu)
        return float(loss.detach()), grad

    def step(self, update: torch.Tensor, lr: float) -> None:
        """Momentum SGD: v <- m v + update; params <- params - lr v."""
        self.velocity.mul_(self.momentum).add_(update)
        self.set_params(self.params.sub_(self.velocity, alpha=lr))

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch: int = 2048) -> tuple[float, float]:
        """Mean loss and accuracy of the current model on (x, y)."""
        self.model.eval()
        loss, correct = 0.0, 0
        for i in range(0, len(x), batch):
            out = self.model(x[i : i + batch])
            loss += float(F.cross_entropy(out, y[i : i + batch], reduction="sum"))
            correct += int((out.argmax(dim=1) == y[i : i + batch]).sum())
        return loss / len(x), correct / len(x)

    def snapshot(self, residual: torch.Tensor | None) -> Snapshot:
        return Snapshot(
            self.params, self.velocity.clone(), None if residual is None else residual.clone()
        )

    def restore(self, snap: Snapshot, residual: torch.Tensor | None) -> None:
        self.set_params(snap.params)
        self.velocity.copy_(snap.velocity)
        if residual is not None and snap.residual is not None:
            residual.copy_(snap.residual)

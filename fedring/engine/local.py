"""Local work of a member whose update goes to a server rather than through the group's
collective: the async star's agents and Flower's nodes.

`LocalWork` computes a gradient on the next batch, or takes `steps` local steps
with the wrapped `torch.optim` optimizer (its state cleared first: each round's
local steps start afresh from the model just received). The caller compresses
what it sends with `engine.reducer.compress_update` (error feedback included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedring.engine.sampler import ShardSampler
from fedring.engine.task import LossFn
from fedring.training.models import flat_grads, flat_params, set_flat_params


@dataclass
class LocalWork:
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: LossFn
    sampler: ShardSampler
    optimizer: torch.optim.Optimizer

    @property
    def params(self) -> torch.Tensor:
        return flat_params(self.model)

    def set_params(self, flat: torch.Tensor) -> None:
        set_flat_params(self.model, flat)

    def _backward(self) -> float:
        idx = torch.tensor(self.sampler.next_batch())
        self.model.train()
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(self.x[idx]), self.y[idx])
        loss.backward()
        return float(loss.detach())

    def gradient(self) -> tuple[float, torch.Tensor]:
        """Loss and flat gradient on the next batch (parameters unchanged)."""
        loss = self._backward()
        return loss, flat_grads(self.model)

    def steps(self, steps: int, lr: float) -> list[float]:
        """`steps` optimizer steps at rate `lr`, from a fresh optimizer state."""
        self.optimizer.state.clear()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        for _ in range(steps):
            losses.append(self._backward())
            self.optimizer.step()
        return losses

"""One member's whole training state, as one object with a `state_dict`.

`TrainerState` bundles the model (parameters and buffers), the distributed
optimizer (the wrapped optimizer's state, the reducer's error-feedback residual,
local mode's anchor, a delayed gradient) and the batch sampler. Its `state_dict`
is plain tensors, numbers and lists, so ``torch.save`` writes it and
``torch.load(..., weights_only=True)`` reads it back; `snapshot` and `restore`
keep deep copies in memory (rollback on divergence, the agent's last rounds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedring.engine.optimizer import DistributedOptimizer
from fedring.engine.sampler import ShardSampler
from fedring.engine.wrapped import copied
from fedring.training.models import flat_params, set_flat_params


@dataclass
class TrainerState:
    """The model, the distributed optimizer and the sampler of one member."""

    model: nn.Module
    optimizer: DistributedOptimizer
    sampler: ShardSampler | None = None

    @property
    def params(self) -> torch.Tensor:
        """A flat float32 copy of the parameters (the layout the group exchanges)."""
        return flat_params(self.optimizer.params)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
        }
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.sampler is not None and "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])

    def snapshot(self, *, with_sampler: bool = True) -> dict[str, Any]:
        """A deep copy of `state_dict` (without the sampler: a rollback goes on with
        new batches rather than the ones that led it astray)."""
        state = copied(self.state_dict())
        if not with_sampler:
            state.pop("sampler", None)
        return state

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        self.load_state_dict(copied(snapshot))

    def load_params(self, flat: torch.Tensor) -> None:
        """Start from these parameters (a checkpoint's): optimizer state and any
        delayed gradient dropped, error feedback kept, the synced model reset."""
        set_flat_params(self.optimizer.params, flat)
        self.optimizer.optimizer.state.clear()
        self.optimizer.drop_pending()
        self.optimizer.reset_anchor()

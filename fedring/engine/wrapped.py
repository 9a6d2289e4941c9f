"""The wrapped `torch.optim` optimizer as a wrapper shows it: its parameter groups,
defaults and state, and deep copies of its state dict.

`torch.optim.lr_scheduler` reads and writes ``param_groups`` (and ``defaults``,
``state``) of the optimizer it is given; a `WrappedOptimizer` hands those of the
optimizer it wraps, so a scheduler given the wrapper changes the wrapped
optimizer's ``lr``. `DistributedOptimizer` is one.
"""

from __future__ import annotations

from typing import Any

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose groups, defaults and state are `optimizer`'s.

    `torch.optim.Optimizer.__init__` is not called: the wrapped optimizer holds
    what this one shows. A subclass sets `optimizer` when it is built.
    """

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state


def copied(state: Any) -> Any:
    """A deep copy of an optimizer state dict: `load_state_dict` keeps references to
    the tensors it is given, and a kept snapshot must not change under training."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: copied(v) for k, v in state.items()}
    if isinstance(state, list):
        return [copied(v) for v in state]
    return state

"""A `torch.optim` optimizer's per-parameter state as plain tensors and numbers.

A Flower node keeps what it remembers between messages in `Context.state`, whose
records hold arrays and plain values, never pickled objects. `OptimizerState`
is the ``"state"`` half of ``optimizer.state_dict()`` flattened to that shape
(``"3/exp_avg"``: parameter 3's AdamW first moment); the ``"param_groups"`` half is
not kept, because the node rebuilds the optimizer from the task every message and
sets each round's learning rate itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Number = int | float | bool


@dataclass
class OptimizerState:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    numbers: dict[str, Number] = field(default_factory=dict)
    nones: list[str] = field(default_factory=list)  # entries whose value is None

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerState:
        out = cls()
        for index, entries in optimizer.state_dict()["state"].items():
            for name, value in entries.items():
                key = f"{index}/{name}"
                if isinstance(value, torch.Tensor):
                    out.tensors[key] = value.detach().clone()
                elif value is None:
                    out.nones.append(key)
                elif isinstance(value, Number):
                    out.numbers[key] = value
                else:
                    raise TypeError(
                        f"optimizer state {key!r} is a {type(value).__name__}: a Flower node "
                        "keeps tensors, numbers and None only"
                    )
        return out

    def load_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Put this state into `optimizer`, freshly built with its param_groups."""
        state: dict[int, dict[str, Any]] = {}
        items: list[tuple[str, Any]] = [*self.tensors.items(), *self.numbers.items()]
        items += [(key, None) for key in self.nones]
        for key, value in items:
            index, name = key.split("/", 1)
            state.setdefault(int(index), {})[name] = value
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": groups})

"""One held-out evaluation per distinct model state among a simulation's members.

In a ``sync`` job every member ends a round with bit-identical parameters and then
evaluates them on the same held-out set (`engine.loop`): N members, N equal
evaluations, the largest cost of a many-agent run on few cores after the ring (64
agents on the synthetic set: about 10 ms each, 61 evaluations each). `SharedEvaluation`
gives each member's call the numbers of an earlier call whose model state (every
parameter and buffer) was equal, entry for entry, and evaluates otherwise; a member
that drifted (a perturbed one, an attacker's, another mode's) is evaluated on its own.

Only for built-in tasks and models (`shareable`), whose evaluation draws no random
numbers and changes nothing but the module's mode: a user's task may do anything,
and skipping its calls could change what it does next.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from fedring.engine.loop import Evaluate
from fedring.engine.task import ClassificationTask, Task

_KEEP = 4  # states remembered: a round's, and a few members that differ from it


class SharedEvaluation:
    """`evaluate` once per model state; the same numbers for every equal state."""

    def __init__(self, evaluate: Evaluate) -> None:
        self._evaluate = evaluate
        self._lock = threading.Lock()
        self._seen: list[tuple[list[tuple[str, torch.Tensor]], tuple[float, float]]] = []
        self.evaluated = 0  # evaluations actually run
        self.shared = 0  # calls answered from an equal state

    def __call__(self, model: nn.Module) -> tuple[float, float]:
        state = [(k, v.detach()) for k, v in model.state_dict().items()]
        with self._lock:
            for seen, result in self._seen:
                if _equal(seen, state):
                    model.eval()  # as the evaluation leaves it
                    self.shared += 1
                    return result
            result = self._evaluate(model)
            self._seen.insert(0, ([(k, v.clone()) for k, v in state], result))
            del self._seen[_KEEP:]
            self.evaluated += 1
            return result


def _equal(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    """Same names, dtypes, shapes and values (a NaN equals nothing: evaluated again)."""
    return len(a) == len(b) and all(
        ka == kb and va.dtype == vb.dtype and torch.equal(va, vb)
        for (ka, va), (kb, vb) in zip(a, b, strict=True)
    )


def shareable(task: Task) -> bool:
    """A built-in classification task on a built-in model (no ``MODULE:FACTORY``)."""
    return type(task) is ClassificationTask and ":" not in task.model_spec

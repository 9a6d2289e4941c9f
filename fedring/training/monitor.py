"""Convergence monitoring: spot divergence from the held-out loss.

A loss that is NaN or Inf, or more than `blowup` times the best loss seen so
far, is divergence: the caller rolls back to its last good state and halves the
learning rate (SEEDS A: "retry automatically or degrade"). Every agent feeds the
same numbers (same parameters, same held-out set), so every agent reaches the
same verdict without a message.

    >>> m = Monitor(blowup=4.0)
    >>> [m.check(v) for v in (2.0, 1.0, 3.9, 4.5, float("nan"))]
    ['ok', 'ok', 'ok', 'rollback', 'rollback']
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Monitor:
    blowup: float = 4.0
    best: float = math.inf

    def check(self, loss: float) -> str:
        """'ok', or 'rollback' when `loss` is not finite or blew up."""
        if not math.isfinite(loss) or loss > self.blowup * self.best:
            return "rollback"
        self.best = min(self.best, loss)
        return "ok"

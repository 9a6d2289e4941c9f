"""Client sampling: which agents train in round r, and what one that sat out does
with its error-feedback residual.

`sampled(seed, r, n, sample)` is a pure function of the job's seed and the round,
so the coordinator, Flower's ServerApp and `fedring simulate` pick the same agents
without telling anyone, and a log line or summary row can name them. An agent that
is not sampled neither trains nor sends; the centre still sends it the round's
result, so it holds the same model as the others.

Error feedback keeps, in each agent's residual, what compression has not sent yet.
An agent that sits out for m rounds comes back with a residual computed against a
model m rounds old; `SitOut` says what to do with it: ``keep`` it, ``reset`` it to
zero, or ``decay:G`` it by G**m.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the sampling rule imports no torch: the load generator shares it
    import torch


def per_round(n: int, sample: float) -> int:
    """Agents per round: round(sample x n) for a fraction (at least 1), else the number."""
    if sample <= 1:
        return max(1, min(n, math.floor(sample * n + 0.5)))
    return min(n, int(sample))


def sampled(seed: int, r: int, n: int, sample: float) -> list[int]:
    """The ranks (of n) that train in round r, in order; all of them when sample = 1."""
    k = per_round(n, sample)
    if k >= n:
        return list(range(n))
    rng = np.random.default_rng([seed, r, 0x5A4D])  # 0x5A4D: apart from the batch seeds
    return sorted(int(i) for i in rng.choice(n, size=k, replace=False))


@dataclass(frozen=True)
class SitOut:
    """The residual policy for an agent back from `missed` rounds out."""

    kind: str  # keep | reset | decay
    factor: float = 1.0  # decay: x factor per round missed

    @classmethod
    def parse(cls, text: str) -> SitOut:
        kind, sep, arg = str(text).partition(":")
        if kind in ("keep", "reset") and not sep:
            return cls(kind)
        if kind == "decay" and sep:
            try:
                factor = float(arg)
            except ValueError:
                factor = math.nan
            if 0 <= factor <= 1:
                return cls(kind, factor)
            raise ValueError(f"{text!r}: decay:G needs G in [0, 1]")
        raise ValueError(f"{text!r} must be keep, reset or decay:G")

    def apply(self, residual: torch.Tensor, missed: int) -> None:
        """Adjust `residual` in place for `missed` rounds sat out (nothing if none)."""
        if missed <= 0 or self.kind == "keep":
            return
        if self.kind == "reset":
            residual.zero_()
        else:
            residual.mul_(self.factor**missed)

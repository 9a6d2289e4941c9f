"""Aggregation rules (SEEDS A.1-A.3, B), as plain functions on stacked updates.

`updates` is a float tensor [N, D], one row per agent. The ring computes `mean`,
`weighted` (each agent pre-scales by its weight, the ring sums) and `sign_vote`
(see `fedring.collective.vote`) without ever stacking; `median` and
`trimmed_mean` need every update in one place (star topology or async).

    >>> u = torch.tensor([[1., -2.], [3., 0.], [100., 1.]])
    >>> median(u).tolist(), sign_vote(u).tolist()
    ([3.0, 0.0], [1.0, 0.0])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

KINDS = ("mean", "weighted", "vote", "hybrid", "median", "trimmed")


@dataclass(frozen=True)
class Aggregation:
    """A parsed rule: ``mean``, ``weighted``, ``vote``, ``hybrid:L`` or ``hybrid:L0-L1``
    (lambda scheduled linearly from L0 to L1), ``median``, ``trimmed:BETA``."""

    kind: str
    lam0: float = 1.0
    lam1: float = 1.0
    beta: float = 0.1

    @classmethod
    def parse(cls, spec: str) -> Aggregation:
        kind, _, arg = spec.partition(":")
        if kind not in KINDS:
            raise ValueError(f"aggregation {spec!r} is not one of {', '.join(KINDS)} (with :ARG)")
        if kind == "hybrid":
            try:
                parts = [float(v) for v in arg.split("-")] if arg else [0.5]
            except ValueError:
                raise ValueError(
                    f"aggregation {spec!r}: lambda must be a number or L0-L1"
                ) from None
            if len(parts) > 2 or not all(0.0 <= p <= 1.0 for p in parts):
                raise ValueError(f"aggregation {spec!r}: lambda must be in [0, 1]")
            return cls(kind, parts[0], parts[-1])
        if kind == "trimmed":
            try:
                beta = float(arg) if arg else 0.1
            except ValueError:
                raise ValueError(f"aggregation {spec!r}: BETA must be a number") from None
            if not 0.0 <= beta < 0.5:
                raise ValueError(f"aggregation {spec!r}: BETA must be in [0, 0.5)")
            return cls(kind, beta=beta)
        if arg:
            raise ValueError(f"aggregation {spec!r}: {kind} takes no argument")
        return cls(kind)

    @property
    def averaged(self) -> bool:
        """Updates are averaged: the linear LR scaling rule applies."""
        return self.kind in ("mean", "weighted", "hybrid")

    @property
    def needs_star(self) -> bool:
        return self.kind in ("median", "trimmed")

    def lam(self, round: int, rounds: int) -> float:
        """Hybrid lambda at `round`: more global early, more local late when scheduled."""
        frac = round / max(1, rounds - 1)
        return self.lam0 + (self.lam1 - self.lam0) * frac


def mean(updates: torch.Tensor) -> torch.Tensor:
    return updates.mean(dim=0)


def capped_weights(sizes: Sequence[int], cap: float) -> torch.Tensor:
    """Weights by sample count, none above `cap` x its equal share, summing to 1.

    The sizes come from the coordinator's shard manifest, never from what an
    agent reports about itself.
    """
    w = torch.tensor(sizes, dtype=torch.float64)
    w = w / w.sum()
    limit = cap / len(sizes)
    for _ in range(len(sizes)):  # clip, hand the excess to the others, repeat
        over = w > limit
        if not bool(over.any()):
            break
        excess = float((w[over] - limit).sum())
        w[over] = limit
        under = ~over
        w[under] += excess * w[under] / w[under].sum()
    return w.to(torch.float32)


def weighted(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (updates * weights[:, None]).sum(dim=0)


def median(updates: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median (lower middle for even N, as torch does)."""
    return updates.median(dim=0).values


def trimmed_mean(updates: torch.Tensor, beta: float) -> torch.Tensor:
    """Coordinate-wise mean after dropping the floor(beta*N) largest and smallest."""
    n = updates.shape[0]
    cut = int(beta * n)
    ordered = updates.sort(dim=0).values
    return ordered[cut : n - cut].mean(dim=0)


def sign_vote(updates: torch.Tensor) -> torch.Tensor:
    """sign(sum of signs): the majority of the agents' signs, 0 on a tie."""
    return torch.sign(torch.sign(updates).sum(dim=0))


def hybrid(global_update: torch.Tensor, local_update: torch.Tensor, lam: float) -> torch.Tensor:
    """lambda * global + (1 - lambda) * local."""
    return lam * global_update + (1.0 - lam) * local_update

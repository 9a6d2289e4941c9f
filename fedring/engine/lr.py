"""Linear learning-rate scaling with gradual warm-up, for a wrapped optimizer's groups.

    scaling = LinearScaling(optimizer, world=4, warmup_steps=50)
    for step in ...:
        scaling.apply(step)     # every group: its own lr x the scaled, warmed-up factor

Each parameter group keeps its own base rate (its ``initial_lr``, set from the ``lr``
it had when first wrapped, as torch's own schedulers do) and
follows `training.lr.LrSchedule` from it (tuning guide there): ramp from the base
rate to base x N·b/b_ref over `warmup_steps` (Goyal et al. 2017), the square root
of that factor with ``scaling="sqrt"`` (the safer choice for Adam), or no change
with ``"none"`` or when updates are summed rather than averaged. `factor` is an
extra multiplier, halved by the divergence monitor on a rollback.
"""

from __future__ import annotations

import torch

from fedring.training.lr import LrSchedule


class LinearScaling:
    """Per-group scaled learning rates with warm-up (see the module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        world: int,
        batch_size: int = 32,
        ref_batch: int = 32,
        warmup_steps: int = 0,
        scaling: str = "linear",
        averaged: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.schedules = [
            LrSchedule(
                base_lr=float(g.setdefault("initial_lr", g["lr"])), scaling=scaling,
                n_agents=world, batch_size=batch_size, ref_batch=ref_batch,
                warmup_steps=warmup_steps, averaged=averaged,
            )
            for g in optimizer.param_groups
        ]
        self.factor = 1.0

    def apply(self, step: int) -> float:
        """Set every group's rate for `step`; return the first group's."""
        for group, schedule in zip(self.optimizer.param_groups, self.schedules, strict=True):
            group["lr"] = schedule.lr_at(step) * self.factor
        return float(self.optimizer.param_groups[0]["lr"])

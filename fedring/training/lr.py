"""Learning-rate rule for n agents that average their updates: scaling plus warm-up.

Tuning guide, in the order to set things:

1. Tune `base_lr` on one agent at `ref_batch` (or take it from the literature).
2. Leave ``scaling="linear"``. When n agents each take a batch of b and the ring
   averages their gradients, one step sees n*b examples: the gradient noise shrinks
   and the step can grow by the same factor, n*b / ref_batch (Goyal et al. 2017,
   "Accurate, Large Minibatch SGD"). This keeps the per-example step size of the
   single-agent run.
3. Use ``warmup_steps`` whenever the factor is well above 1. Early on the weights
   change fast and the large scaled rate can diverge; ramping linearly from
   `base_lr` to `peak_lr` over the first steps (a few epochs' worth in Goyal et al.;
   a few hundred steps here) avoids that at almost no cost.
4. Switch to ``scaling="sqrt"`` for adaptive optimizers (Adam) or when linear
   scaling diverges even with warm-up: scaling the rate by the square root keeps the
   variance of the update constant (Krizhevsky 2014; Hoffer et al. 2017; for Adam,
   Malladi et al. 2022) and is the safer choice at large factors.
5. ``scaling="none"`` or ``averaged=False`` keeps `base_lr`: when updates are summed
   rather than averaged, the sum already grows with n and scaling again would
   double-count it.

    >>> s = LrSchedule(base_lr=0.1, n_agents=4, warmup_steps=10)
    >>> s.peak_lr, s.lr_at(0), s.lr_at(5), s.lr_at(10)
    (0.4, 0.1, 0.25, 0.4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCALINGS = ("linear", "sqrt", "none")


@dataclass(frozen=True)
class LrSchedule:
    """Scaled peak rate with Goyal et al. gradual warm-up; see the module guide."""

    base_lr: float  # tuned for one agent at ref_batch
    scaling: str = "linear"  # "linear" | "sqrt" | "none"
    n_agents: int = 1  # agents whose updates are averaged each step
    batch_size: int = 32  # per agent
    ref_batch: int = 32  # the batch base_lr was tuned for
    warmup_steps: int = 0  # steps to ramp from base_lr to peak_lr
    averaged: bool = True  # scaling applies only when updates are averaged

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ValueError(f"base_lr={self.base_lr} must be a finite number > 0")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling={self.scaling!r} must be one of {', '.join(SCALINGS)}")
        for name in ("n_agents", "batch_size", "ref_batch"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")

    @property
    def peak_lr(self) -> float:
        """Rate after warm-up: `base_lr` times the scaling factor.

        The factor is n_agents * batch_size / ref_batch for ``"linear"``, its square
        root for ``"sqrt"``, and 1 for ``"none"`` or when updates are not averaged.
        """
        if self.scaling == "none" or not self.averaged:
            return self.base_lr
        factor = self.n_agents * self.batch_size / self.ref_batch
        if self.scaling == "sqrt":
            factor = math.sqrt(factor)
        return self.base_lr * factor

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based).

        Parameters
        ----------
        step : int
            Steps taken so far; must be >= 0.

        Returns
        -------
        float
            `base_lr` at step 0, rising linearly to reach `peak_lr` at
            ``step == warmup_steps``, then `peak_lr` from there on.
        """
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        peak = self.peak_lr
        if step >= self.warmup_steps:
            return peak
        return self.base_lr + (peak - self.base_lr) * step / self.warmup_steps

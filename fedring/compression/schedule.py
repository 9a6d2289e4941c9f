"""Density warm-up: start nearly dense, reach the target density in stages.

DGC (Lin et al. 2018) warms up with exponentially falling density, e.g.
25% -> 6.25% -> 1.56% -> 0.4% -> target, so the first, large and fast-changing
gradients are not squeezed through a 1% keyhole.

    >>> s = DensitySchedule(target=0.01, stages=(0.25, 0.0625), steps_per_stage=10)
    >>> [s.density(step) for step in (0, 9, 10, 20, 1000)]
    [0.25, 0.25, 0.0625, 0.01, 0.01]

A closing flush (`flush` rounds of `rounds`) sends every entry at the end, so what
error feedback holds reaches the model (`compression.policy`):

    >>> DensitySchedule(target=0.075, steps_per_stage=0, rounds=40, flush=1).density(39)
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass

DGC_STAGES = (0.25, 0.0625, 0.015625, 0.004)


@dataclass(frozen=True)
class DensitySchedule:
    """Density for each step: the `stages` in turn, then `target`."""

    target: float
    stages: tuple[float, ...] = DGC_STAGES
    steps_per_stage: int = 0  # 0 turns the warm-up off
    rounds: int = 0  # the job's rounds, for the closing flush
    flush: int = 0  # the last `flush` of `rounds` send every entry (density 1)

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"target density {self.target} must be in (0, 1]")
        if self.steps_per_stage < 0:
            raise ValueError(f"steps_per_stage={self.steps_per_stage} must be >= 0")
        if self.flush < 0 or (self.flush and self.rounds < 1):
            raise ValueError(f"flush={self.flush} needs rounds >= 1 (rounds={self.rounds})")
        for d in self.stages:
            if not 0.0 < d <= 1.0:
                raise ValueError(f"warm-up density {d} must be in (0, 1]")

    @classmethod
    def of(cls, target: float, warmup: int, rounds: int, flush: int) -> DensitySchedule | None:
        """A job's schedule (`warmup` rounds a stage, the last `flush` of `rounds`);
        None when it has neither: the codec's own density every round."""
        if not (warmup or flush):
            return None
        return cls(target, steps_per_stage=warmup, rounds=rounds, flush=flush)

    @property
    def active(self) -> tuple[float, ...]:
        """The warm-up's stages it sends: those above the target (the rest are skipped)."""
        return tuple(d for d in self.stages if d > self.target)

    @property
    def warmup_steps(self) -> int:
        """Steps of the warm-up: `steps_per_stage` for each `active` stage."""
        return self.steps_per_stage * len(self.active)

    def density(self, step: int) -> float:
        """The density at `step` (0-based); stages below the target are skipped."""
        if self.flush and step >= self.rounds - self.flush:
            return 1.0
        if self.steps_per_stage and step < self.warmup_steps:
            return self.active[step // self.steps_per_stage]
        return self.target

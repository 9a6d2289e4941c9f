"""A test harness for robust aggregation: agents that send poisoned updates.

Never on by default: an attack is asked for by name (`fedring simulate --attack`,
`fedring agent --attack`) and applies only to the members it is built for. An
attacking member trains as any other; what it hands to its reducer (the gradient
in sync mode, the parameter delta in local mode, a star's upload) is transformed
first, so the poisoned vector then goes through error feedback, the compressor and
the collective exactly as an honest one would.

Attacks, as ``KIND[:ARG]``:

``sign-flip``
    sends ``-u`` instead of the update ``u``.
``scale[:FACTOR]``
    sends ``FACTOR * u`` (default -10: a sign flip ten times as large).
``noise[:SIGMA]``
    sends Gaussian noise instead of ``u``: entries with standard deviation SIGMA
    times the update's own RMS (default 10, so the noise's norm is about ten times
    the update's), seeded by the member, the round and the bucket.
``label-flip``
    data-level: the member trains on its shard with labels ``y -> C - 1 - y``
    (C classes) and sends its honest update of those.

>>> import torch
>>> a = Attack.parse("scale:-10")
>>> a.kind, a.arg, str(a)
('scale', -10.0, 'scale:-10')
>>> a.update(torch.tensor([1.0, -2.0])).tolist()
[-10.0, 20.0]
>>> Attack.parse("label-flip").labels(torch.tensor([0, 1, 9]), num_classes=10).tolist()
[9, 8, 0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fedring.counters import Counters
from fedring.engine.reducer import Reducer

__all__ = ["ATTACKS", "Attack", "AttackingReducer", "flip_labels"]

# kind -> default argument (None: the kind takes none)
ATTACKS: dict[str, float | None] = {
    "sign-flip": None,
    "scale": -10.0,
    "noise": 10.0,
    "label-flip": None,
}
COUNTER = "attack_updates"  # an attacking member's poisoned updates, one per round


@dataclass(frozen=True)
class Attack:
    """One attack: `kind` (a key of `ATTACKS`) and its argument (None: the kind takes none)."""

    kind: str
    arg: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(
                f"attack {self.kind!r}: expected one of {', '.join(ATTACKS)} (as KIND[:ARG])"
            )
        if ATTACKS[self.kind] is None:
            if self.arg is not None:
                raise ValueError(f"attack {self.kind!r} takes no argument, got {self.arg!r}")
            return
        arg = ATTACKS[self.kind] if self.arg is None else self.arg
        if not isinstance(arg, int | float) or isinstance(arg, bool) or not math.isfinite(arg):
            raise ValueError(f"attack {self.kind!r}: argument {arg!r} must be a finite number")
        if self.kind == "noise" and arg <= 0:
            raise ValueError(f"attack 'noise': SIGMA {arg!r} must be > 0")
        object.__setattr__(self, "arg", float(arg))

    @classmethod
    def parse(cls, spec: str) -> Attack:
        """``KIND[:ARG]``, e.g. ``sign-flip``, ``scale:-10``, ``noise:5``, ``label-flip``."""
        if not isinstance(spec, str):
            raise ValueError(f"attack {spec!r}: expected a string KIND[:ARG]")
        kind, sep, arg = spec.strip().partition(":")
        if not sep:
            return cls(kind)
        try:
            value = float(arg)
        except ValueError:
            raise ValueError(f"attack {spec!r}: argument {arg!r} is not a number") from None
        if kind in ATTACKS and ATTACKS[kind] is None:
            raise ValueError(f"attack {spec!r}: {kind!r} takes no argument")
        return cls(kind, value)

    def __str__(self) -> str:
        if self.arg is None:
            return self.kind
        arg = int(self.arg) if self.arg.is_integer() else self.arg
        return f"{self.kind}:{arg}"

    @property
    def data_level(self) -> bool:
        """The attack changes the member's training data, not the update it sends."""
        return self.kind == "label-flip"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "arg": self.arg, "spec": str(self)}

    def update(self, vec: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
        """The vector the attacker sends instead of `vec` (a new tensor; `vec` is kept).

        `seed` draws the noise (the same seed, the same noise); the other kinds
        ignore it. A data-level attack returns `vec` itself.
        """
        if self.kind == "sign-flip":
            return -vec
        if self.kind == "scale":
            assert self.arg is not None
            return vec * self.arg
        if self.kind == "noise":
            assert self.arg is not None
            rms = float(torch.linalg.vector_norm(vec)) / math.sqrt(max(vec.numel(), 1))
            gen = torch.Generator().manual_seed(seed % 2**63)
            noise = torch.randn(vec.shape, generator=gen, dtype=torch.float32)
            return (noise * (self.arg * rms)).to(vec.dtype)
        return vec

    def labels(self, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        """The labels the attacker trains on: flipped for ``label-flip``, else `y`."""
        return flip_labels(y, num_classes) if self.kind == "label-flip" else y


def flip_labels(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``y -> C - 1 - y`` for class labels 0..C-1 (a new tensor).

    >>> flip_labels(torch.tensor([0, 2, 1]), 3).tolist()
    [2, 0, 1]
    """
    if num_classes < 2:
        raise ValueError(
            f"label-flip needs class labels (num_classes >= 2), got num_classes={num_classes}"
        )
    if y.dtype.is_floating_point:
        raise ValueError(f"label-flip needs integer class labels, got {y.dtype}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"label-flip: labels outside 0..{num_classes - 1}")
    return (num_classes - 1) - y


def _noise_seed(seed: int, round: int, bucket: int = 0) -> int:
    """One seed per member, round and bucket."""
    return (seed * 1_000_003 + round) * 1_009 + bucket


@dataclass
class AttackingReducer(Reducer):
    """A `Reducer` whose member attacks: every update it is handed is transformed by
    `attack` before error feedback, the compressor and the collective. Built only for
    attacking members (`fedring.build.member` with an attack); dense side-channels
    (BatchNorm statistics, re-sync) pass untouched.

    `seed` draws the noise (one per member); `counters`, when given, counts each
    poisoned update as ``attack_updates`` (one per round: a bucketed round's buckets
    count once); `attacked` counts them too.
    """

    attack: Attack = field(kw_only=True)
    seed: int = field(default=0, kw_only=True)
    counters: Counters | None = field(default=None, kw_only=True, repr=False)
    attacked: int = field(default=0, init=False)

    def _poison(self, vec: torch.Tensor, round: int, bucket: int = 0) -> torch.Tensor:
        if bucket == 0:
            self.attacked += 1
            if self.counters is not None:
                self.counters.add(COUNTER)
        return self.attack.update(vec, seed=_noise_seed(self.seed, round, bucket))

    def allreduce(self, vec: torch.Tensor, *, scale: float, round: int) -> torch.Tensor:
        return super().allreduce(self._poison(vec, round), scale=scale, round=round)

    def allreduce_bucket(
        self, vec: torch.Tensor, *, span: tuple[int, int], scale: float, round: int, bucket: int
    ) -> torch.Tensor:
        return super().allreduce_bucket(
            self._poison(vec, round, bucket), span=span, scale=scale, round=round, bucket=bucket
        )

    def vote(self, vec: torch.Tensor, *, round: int) -> torch.Tensor:
        return super().vote(self._poison(vec, round), round=round)

    def star(self, vec: torch.Tensor, *, round: int, scale: float = 1.0) -> torch.Tensor:
        return super().star(self._poison(vec, round), round=round, scale=scale)

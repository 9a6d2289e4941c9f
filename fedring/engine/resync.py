"""Re-synchronisation of a mixed-architecture group: the head's parameters, every K rounds.

In ``sync`` mode every member applies the same agreed update, so members on the
same CPU architecture hold the same bits after every round. Members on different
architectures do not: x86_64 and aarch64 builds of torch round some float
operations differently (fused multiply-add contraction in the optimizer's step,
other reduction orders in matmul), so after a few rounds an aarch64 member's
parameters differ from an x86 member's in the last bits, and the difference grows
slowly with every step. The accuracy is the same; the per-round hash check is not.

The policy (job fields ``resync`` and ``resync_every``): every K rounds, and at the
last round, the ring's head (rank 0) all-reduces its parameters with zeros from
every other member, a plain fp32 sum over the same ring, so every member ends that
round with the head's bytes (``x + 0.0 == x`` for every finite ``x``; a ``-0.0``
becomes ``+0.0`` on every member alike). Before taking them, each member measures
how far it had drifted from the head (max |difference| and its L2 norm): the
summary reports that drift. Between re-syncs, hashes are compared within an
architecture class; at a re-sync round, across the whole fleet.

Cost: one dense all-reduce, 2(N-1)/N x 4 bytes per parameter per agent, every K
rounds. A fleet of one architecture never re-syncs under ``resync = "mixed"`` (the
default), so its bytes and its hashes are those of a job without this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedring.engine.optimizer import DistributedOptimizer
from fedring.training.models import flat_params, set_flat_params

RESYNC_BUCKET = -2  # frame tag of the re-sync all-reduce (buffers use -1, gradients none)
RESYNC_POLICIES = ("mixed", "always", "never")


@dataclass(frozen=True)
class ResyncSettings:
    """When the group takes the head's parameters (0 = never)."""

    every: int = 0  # K: rounds between re-syncs, the last round always included

    def due(self, r: int, rounds: int) -> bool:
        """Whether round `r` (0-based) of `rounds` ends with a re-sync."""
        return self.every > 0 and ((r + 1) % self.every == 0 or r + 1 == rounds)


def resync_every(policy: str, every: int, mixed: bool) -> int:
    """K for a job: `every` under "always", or under "mixed" when the fleet mixes
    CPU architectures; 0 otherwise."""
    if policy not in RESYNC_POLICIES:
        raise ValueError(f"resync policy {policy!r} must be one of {', '.join(RESYNC_POLICIES)}")
    return every if policy == "always" or (policy == "mixed" and mixed) else 0


@dataclass(frozen=True)
class Drift:
    """How far one member's parameters were from the head's before a re-sync."""

    max_abs: float
    l2: float

    def row(self) -> dict[str, float]:
        return {"drift_max_abs": self.max_abs, "drift_l2": self.l2}


def resync(opt: DistributedOptimizer, r: int) -> Drift:
    """Give every member the head's parameters (a collective call: every member of
    the group calls it for the same round); return this member's drift."""
    own = flat_params(opt.params)
    head = opt.reducer.collective.rank == 0
    agreed = opt.reducer.allreduce_dense(
        own if head else torch.zeros_like(own), round=r, bucket=RESYNC_BUCKET
    )
    diff = agreed - own
    drift = Drift(float(diff.abs().max()) if diff.numel() else 0.0, float(diff.norm()))
    set_flat_params(opt.params, agreed)
    opt.anchor = agreed.clone()  # local mode: the synced model is the head's too
    return drift


def summarise(drifts: list[tuple[str, int, Drift]], every: int) -> dict[str, object]:
    """The summary's ``drift``: the largest before any re-sync, per member and overall.

    `drifts` holds (member, round, drift) of every re-sync.
    """
    by_member: dict[str, dict[str, float]] = {}
    for name, _, d in drifts:
        seen = by_member.setdefault(name, {"max_abs": 0.0, "l2": 0.0})
        seen["max_abs"] = max(seen["max_abs"], d.max_abs)
        seen["l2"] = max(seen["l2"], d.l2)
    rounds = sorted({r for _, r, _ in drifts})
    return {
        "resync_every": every,
        "resyncs": len(rounds),
        "max_abs": max((d.max_abs for _, _, d in drifts), default=0.0),
        "l2": max((d.l2 for _, _, d in drifts), default=0.0),
        "by_member": dict(sorted(by_member.items())),
    }


def nudge(model: torch.nn.Module, scale: float, *, seed: int) -> None:
    """Add seeded noise of about `scale` to every parameter: a test's stand-in for a
    member whose CPU rounds differently (``FEDRING_INJECT_DRIFT`` on an agent)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)

"""Sign majority vote over the ring (signSGD with majority vote, SEEDS part A.2).

Each member contributes sign(x) in {-1, 0, 1}. Reduce-scatter sums the signs as
small integers (int8 up to 127 members, int16 beyond): a quarter of the dense
fp32 bytes. The member holding a fully summed chunk takes its sign, and the
all-gather circulates it as two packed bit planes (positive, non-zero): 2 bits an
entry. Every member ends with ``sign(sum_r sign(x_r))``; ties give 0.
"""

from __future__ import annotations

import torch

from fedring.collective.ring import Ring, chunk_bounds
from fedring.compression.payload import Payload
from fedring.compression.quantize import DenseChunk, SignBits


def majority_vote(ring: Ring, x: torch.Tensor, *, round: int = 0) -> torch.Tensor:
    """The element-wise majority of the members' signs, as int8 in {-1, 0, 1}."""
    count_dtype = torch.int8 if ring.world <= 127 else torch.int16
    flat = x.detach().reshape(-1)
    acc = torch.sign(flat).to(torch.int32)
    numel = acc.numel()
    bounds = chunk_bounds(numel, ring.world)

    def counts(c: int) -> DenseChunk:
        a, b = bounds[c]
        return DenseChunk(numel, a, acc[a:b].to(count_dtype))

    def add_counts(c: int, p: Payload) -> None:
        a, b = bounds[c]
        acc[a:b] += p.values.to(torch.int32)  # type: ignore[attr-defined]

    def take_votes(c: int, p: Payload) -> None:
        a, b = bounds[c]
        votes[a:b] = p.signs()  # type: ignore[attr-defined]

    mine = ring.reduce_scatter(
        counts, add_counts, bounds=bounds, expect=DenseChunk, phase="vote-rs", round=round
    )
    votes = torch.sign(acc).to(torch.int8)
    a, b = bounds[mine]
    ring.all_gather(
        SignBits.from_signs(votes[a:b], numel, a),
        take_votes,
        bounds=bounds,
        expect=SignBits,
        phase="vote-ag",
        round=round,
    )
    return votes

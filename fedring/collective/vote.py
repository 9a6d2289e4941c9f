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

    for s in range(ring.world - 1):
        send_c, recv_c = (ring.rank - s) % ring.world, (ring.rank - s - 1) % ring.world
        got = ring.exchange(
            counts(send_c),
            round=round,
            step=s,
            phase="vote-rs",
            expect=DenseChunk,
            span=bounds[recv_c],
        )
        a, b = bounds[recv_c]
        acc[a:b] += got.values.to(torch.int32)  # type: ignore[attr-defined]
    votes = torch.sign(acc).to(torch.int8)
    mine = (ring.rank + 1) % ring.world
    a, b = bounds[mine]
    current = SignBits.from_signs(votes[a:b], numel, a)
    for s in range(ring.world - 1):
        recv_c = (ring.rank - s) % ring.world
        current = ring.exchange(
            current, round=round, step=s, phase="vote-ag", expect=SignBits, span=bounds[recv_c]
        )  # type: ignore[assignment]
        a, b = bounds[recv_c]
        votes[a:b] = current.signs()
    return votes

"""Two-dimensional ring all-reduce: rows, then columns, then rows again.

N = R x C members sit in a grid in ring order (row i holds members i*C .. i*C+C-1).
An all-reduce runs in three stages:

1. reduce-scatter along the row (C-1 steps): member (i, j) ends holding row chunk
   (j + 1) mod C, summed over its row;
2. all-reduce of that chunk down the column (2(R-1) steps): every member of
   column j holds the same row chunk, so they reduce it together and all end
   with it summed over the whole grid;
3. all-gather along the row (C-1 steps).

Each member sends 2(C-1)/C + 2(R-1)/(RC) = 2(N-1)/N of the vector, exactly what
the flat ring sends, in 2(C-1) + 2(R-1) steps instead of 2(N-1): 20 instead of
62 at N = 32. Fewer steps means fewer frame headers on the wire and less latency
per round on real links, and it is what keeps a 32-agent simulation fast.

Sparse ``bounded`` keeps its conservation invariant: every re-selection keeps
``accumulated - sent`` exactly (see `SparseReduction`), so
``sum of inputs == result + sum of kept``, as in the flat ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fedring.collective.channel import PeerChannel
from fedring.collective.ring import Ring, SparsePolicy, SparseReduction, chunk_bounds
from fedring.compression.payload import Payload
from fedring.compression.quantize import DenseChunk
from fedring.compression.sparse import SparseGroups, n_groups


def grid_rows(world: int) -> int:
    """R for an R x C grid: the largest divisor of `world` not above its square root."""
    return max(r for r in range(1, math.isqrt(world) + 1) if world % r == 0)


def layout_rows(topology: str, world: int) -> int:
    """Grid rows for a job's `topology`: 0 means the flat ring.

    ``auto`` takes the torus once it has at least 3 rows (N = 9, 12, 15, 16, ...):
    the same bytes in fewer steps. ``ring`` and ``star`` keep the flat ring (a star
    job still uses it for the sign vote).
    """
    if topology == "torus":
        return grid_rows(world)
    if topology == "auto" and grid_rows(world) >= 3:
        return grid_rows(world)
    return 0


def layout_name(topology: str, world: int) -> str:
    """What the members form, for summaries: ``ring of 8`` or ``torus 4x8``."""
    rows = layout_rows(topology, world)
    return f"torus {rows}x{world // rows}" if rows else f"ring of {world}"


def build_ring(
    channel: PeerChannel, members: tuple[str, ...], topology: str, timeout_s: float
) -> Ring | Torus:
    """The flat `Ring` or the `Torus` the job's topology asks for."""
    rows = layout_rows(topology, len(members))
    return (
        Torus(channel, members, timeout_s, rows=rows) if rows else Ring(channel, members, timeout_s)
    )


def sub_bounds(span: tuple[int, int], parts: int) -> list[tuple[int, int]]:
    """`span` cut into `parts` contiguous, nearly equal ranges."""
    return [(span[0] + a, span[0] + b) for a, b in chunk_bounds(span[1] - span[0], parts)]


@dataclass
class Torus:
    """One member's view of an R x C grid of rings (see the module docstring)."""

    channel: PeerChannel
    members: tuple[str, ...]
    timeout_s: float = 30.0
    rows: int = 0  # R; 0 picks `grid_rows(len(members))`
    flat: Ring = field(init=False)  # the whole grid as one ring (sign vote uses it)

    def __post_init__(self) -> None:
        self.flat = Ring(self.channel, self.members, self.timeout_s)
        self.rank, self.world = self.flat.rank, self.flat.world
        self.rows = self.rows or grid_rows(self.world)
        if self.world % self.rows:
            raise ValueError(f"rows={self.rows} does not divide {self.world} members")
        self.cols = self.world // self.rows
        i, j = divmod(self.rank, self.cols)
        self.row = Ring(
            self.channel, self.members[i * self.cols : (i + 1) * self.cols], self.timeout_s
        )
        self.col = Ring(self.channel, self.members[j :: self.cols], self.timeout_s)

    def allreduce_dense(self, x: torch.Tensor, *, round: int = 0) -> torch.Tensor:
        """Sum of the members' flat float32 vectors, bit-identical on every member."""
        acc = x.detach().reshape(-1).to(torch.float32).clone()
        numel = acc.numel()

        def chunk(span: tuple[int, int]) -> DenseChunk:
            return DenseChunk(numel, span[0], acc[span[0] : span[1]].clone())

        def replace(span: tuple[int, int], p: DenseChunk) -> None:
            acc[span[0] : span[1]].copy_(p.values)

        def add(_: int, p: Payload) -> None:
            p.add_to(acc)

        rb = chunk_bounds(numel, self.cols)
        span = rb[self.row.reduce_scatter(
            lambda c: chunk(rb[c]), add, bounds=rb, expect=DenseChunk, phase="rs", round=round
        )]  # fmt: skip
        cb = sub_bounds(span, self.rows)
        mine = self.col.reduce_scatter(
            lambda c: chunk(cb[c]), add, bounds=cb, expect=DenseChunk, phase="rs2", round=round
        )
        self.col.all_gather(
            chunk(cb[mine]), lambda c, p: replace(cb[c], p),  # type: ignore[arg-type]
            bounds=cb, expect=DenseChunk, phase="ag2", round=round,
        )  # fmt: skip
        self.row.all_gather(
            chunk(span), lambda c, p: replace(rb[c], p),  # type: ignore[arg-type]
            bounds=rb, expect=DenseChunk, phase="ag", round=round,
        )  # fmt: skip
        return acc

    def allreduce_sparse(
        self, sparse: SparseGroups, *, policy: SparsePolicy = "bounded", round: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of the members' group-top-k payloads; returns ``(sum, kept)`` like `Ring`."""
        red = SparseReduction(sparse, policy)
        g = sparse.group_size
        rb = chunk_bounds(n_groups(sparse.numel, g), self.cols)
        span = rb[self.row.reduce_scatter(
            lambda c: red.chunk(rb[c]), red.absorb,
            bounds=rb, expect=red.expect, phase="rs", round=round,
        )]  # fmt: skip
        cb = sub_bounds(span, self.rows)
        mine = self.col.reduce_scatter(
            lambda c: red.chunk(cb[c]), red.absorb,
            bounds=cb, expect=red.expect, phase="rs2", round=round,
        )  # fmt: skip
        out = torch.zeros_like(red.acc)
        reduced = red.chunk(cb[mine])
        reduced.add_to(out)
        self.col.all_gather(
            reduced, lambda _, p: p.add_to(out),
            bounds=cb, expect=red.expect, phase="ag2", round=round,
        )  # fmt: skip
        # Every member of the column now holds the same reduced row chunk: pack it
        # as one payload for the row.
        whole = red.repack(out, span, own=cb[mine])
        self.row.all_gather(
            whole, lambda _, p: p.add_to(out),
            bounds=rb, expect=red.expect, phase="ag", round=round,
        )  # fmt: skip
        return out, red.kept

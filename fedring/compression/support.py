"""A consensus support: the same k coordinates of every group for every member.

A robust rule (median, trimmed mean, centred clipping) over sparse updates sees
real values only where every member sent one; with each member's own top-k the
supports barely overlap and a coordinate-wise median is mostly zeros. With a
consensus support S (k group-local indices in every group of G, one `GroupIndices`)
every member sends its error-compensated values at S, in S's order, so the
centre stacks them as ``[N, n*k]`` and applies the rule to real values;
error feedback subtracts exactly what was sent and keeps the rest.

Before that, each member votes: the top-k indices of its error-compensated update
(`top_indices`), what it would have sent on its own. The centre counts the votes
(`GroupIndices.add_to` adds one per index) and keeps the k most voted entries of
every group (`choose_support`; ties broken by a draw seeded by the job and the
round), so which entries are sent is decided by how many members want them,
never by how large an attacker makes its values; and the support depends on the
round's votes alone, so a centre that restarts picks the same one.

    >>> import torch
    >>> s = GroupIndices.of(torch.tensor([[1], [0]]), numel=4, group_size=2)
    >>> at_support(torch.tensor([5., 6., 7., 8.]), s, "fp32").decompress().tolist()
    [0.0, 6.0, 7.0, 0.0]
    >>> top_indices(torch.tensor([5., 6., 8., 7.]), group_size=2, k=1).indices.tolist()
    [[1], [0]]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedring.compression.payload import (
    Decoded,
    PayloadError,
    PayloadLimits,
    PayloadReason,
    WireArrays,
    array,
    meta_int,
    no_extra,
)
from fedring.compression.sparse import (
    SparseGroups,
    group_header,
    index_dtype,
    n_groups,
    pad_rows,
)
from fedring.compression.values import (
    ValueDtype,
    encode_values,
    exactify_decoded,
    to_numpy,
)

__all__ = ["GroupIndices", "at_support", "choose_support", "scatter", "top_indices"]


@dataclass(frozen=True, eq=False)
class GroupIndices:
    """`k` distinct group-local indices in every group of a flat vector of `numel`,
    no values: a round's support, or one member's votes for it."""

    codec_id: ClassVar[str] = "group-index"
    numel: int
    group_size: int
    indices: torch.Tensor  # [n_groups, k] int64, group-local

    @classmethod
    def of(cls, indices: torch.Tensor, *, numel: int, group_size: int) -> GroupIndices:
        return cls(numel, group_size, indices.to(torch.int64))

    @property
    def k(self) -> int:
        return int(self.indices.shape[1])

    @property
    def n(self) -> int:
        return int(self.indices.shape[0])

    @property
    def size(self) -> int:
        """Entries a value vector on this support holds: ``n * k`` (padding included)."""
        return self.n * self.k

    @property
    def wire_nbytes(self) -> int:
        return self.size * (1 if self.group_size <= 256 else 2)

    def positions(self) -> torch.Tensor:
        """Flat positions [n*k] (int64), group by group; may point past `numel` in
        the padded last group."""
        starts = torch.arange(self.n, dtype=torch.int64)[:, None] * self.group_size
        return (starts + self.indices).reshape(-1)

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> None:
        """Add `alpha` at every index (a vote each): summed, the centre's tally."""
        pos = self.positions()
        pos = pos[pos < out.numel()]
        out.index_add_(0, pos, torch.full((pos.numel(),), alpha, dtype=out.dtype))

    def decompress(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        self.add_to(out)
        return out

    def to_wire(self) -> tuple[dict[str, Any], WireArrays]:
        wire, dtype = index_dtype(self.group_size)
        meta = {"codec": self.codec_id, "numel": self.numel, "group_size": self.group_size,
                "k": self.k}  # fmt: skip
        return meta, [("idx", wire, to_numpy(self.indices.to(dtype)))]

    @classmethod
    def from_wire(
        cls, meta: Mapping[str, Any], arrays: Decoded, limits: PayloadLimits
    ) -> GroupIndices:
        numel, g = group_header(meta, limits)
        k = meta_int(meta, "k", 1, g)
        wire, _ = index_dtype(g)
        _, idx = array(arrays, "idx", (wire,), (n_groups(numel, g), k))
        no_extra(arrays, {"idx"})
        wide = torch.from_numpy(idx.astype(np.int64))
        if int(wide.max()) >= g:
            raise PayloadError(PayloadReason.INDEX_OUT_OF_RANGE,
                               f"index {int(wide.max())} >= group size {g}")  # fmt: skip
        ordered = wide.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):  # one vote per entry
            raise PayloadError(PayloadReason.SHAPE_MISMATCH, "an index repeats in a group")
        return cls(numel, g, wide)


def _top(scores: torch.Tensor, numel: int, group_size: int, k: int) -> GroupIndices:
    rows = pad_rows(scores, group_size)
    pad = rows.numel() - numel
    if pad:
        rows.view(-1)[numel:] = -torch.inf  # padding only when k > the tail's length
    return GroupIndices(numel, group_size, torch.topk(rows, k, dim=1, sorted=False).indices)


def top_indices(x: torch.Tensor, *, group_size: int, k: int) -> GroupIndices:
    """The `k` largest |x| of every group: a member's votes for the next support."""
    return _top(x.reshape(-1).abs(), x.numel(), group_size, k)


def choose_support(tally: torch.Tensor, *, group_size: int, k: int, seed: int) -> GroupIndices:
    """The `k` most voted coordinates of every group of `tally` (votes per coordinate).

    Ties (most coordinates hold one vote or none) are broken by a uniform draw from
    `seed` below one vote, so no part of a group is favoured round after round."""
    gen = torch.Generator().manual_seed(seed % 2**63)
    jitter = torch.rand(tally.numel(), generator=gen, dtype=torch.float32) * 0.5
    return _top(tally.to(torch.float32) + jitter, tally.numel(), group_size, k)


def at_support(g: torch.Tensor, support: GroupIndices, value_dtype: ValueDtype) -> SparseGroups:
    """`g`'s values at `support` (k ≥ 1), encoded in `value_dtype` as group-top-k
    would encode them: what error feedback subtracts (`ErrorFeedback.update`),
    bit for bit what the centre decodes. Values the dtype cannot hold exactly
    enough to subtract (fp16 overflow) are sent as 0 and stay whole in the residual."""
    rows = pad_rows(g.reshape(-1), support.group_size).gather(1, support.indices)
    values, scales = encode_values(rows, value_dtype)
    values, decoded = exactify_decoded(rows, values, scales)
    _, idx_dtype = index_dtype(support.group_size)
    return SparseGroups(support.numel, support.group_size, support.k, 0,
                        support.indices.to(idx_dtype), values, scales, decoded=decoded,
                        wide_indices=support.indices)  # fmt: skip


def scatter(values: torch.Tensor, support: GroupIndices) -> torch.Tensor:
    """A dense float32 vector of `support.numel` holding `values` ([n*k]) at `support`."""
    out = torch.zeros(support.numel, dtype=torch.float32)
    pos = support.positions()
    keep = pos < support.numel
    out[pos[keep]] = values.reshape(-1).to(torch.float32)[keep]
    return out

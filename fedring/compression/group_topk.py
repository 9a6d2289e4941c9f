"""Group-top-k sparsification (the method of SEEDS part C).

The flat gradient is viewed as rows of `group_size` entries (the tail zero-padded)
and each row keeps its `k` largest-magnitude entries. Compared with one global
top-k over the whole vector, every row is selected independently (vectorised,
no Python loop per group), indices fit in one or two bytes, and every ring chunk
aligned to group boundaries carries exactly the same number of entries.

Tuning guide:
- `density` first: 1% (k = round(0.01 G)) is a good start with error feedback on.
- `group_size` 256 gives uint8 indices (3 bytes an entry with fp16 values).
  Larger groups select more globally but need uint16 indices.
- `value_dtype` fp16 halves the bytes at no measurable accuracy cost; int8 adds one
  fp32 scale per group and should be paired with error feedback; sign sends one bit
  per kept entry plus the group's mean kept magnitude (pays off for k >= 16 or so).

    >>> import torch
    >>> c = GroupTopK(group_size=4, k=1).compress(torch.tensor([1., -5, 2, 0, 3, 0]))
    >>> c.decompress().tolist()
    [0.0, -5.0, 0.0, 0.0, 3.0, 0.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedring.compression.sparse import (
    MAX_GROUP_SIZE,
    SparseGroups,
    index_dtype,
    n_groups,
    numpy_view,
)
from fedring.compression.values import (
    ValueDtype,
    check_value_dtype,
    encode_values,
    exactify_decoded,
    from_numpy,
)

_BLOCK_ENTRIES = 1 << 17  # rows per block keep |x| of one block in cache (measured: ~30% faster)


def k_for(density: float, group_size: int) -> int:
    """k = max(1, round(density * G)), capped at G."""
    return min(group_size, max(1, round(density * group_size)))


@dataclass(frozen=True)
class GroupTopK:
    """Keep the `k` largest |x| in every group of `group_size` entries."""

    codec_id = "group-topk"
    group_size: int = 256
    k: int = 3
    value_dtype: ValueDtype = "fp32"

    def __post_init__(self) -> None:
        if not 1 <= self.group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"group_size={self.group_size} must be in [1, {MAX_GROUP_SIZE}]")
        if not 1 <= self.k <= self.group_size:
            raise ValueError(f"k={self.k} must be in [1, group_size={self.group_size}]")
        check_value_dtype(self.value_dtype)

    @classmethod
    def from_density(
        cls, density: float, group_size: int = 256, value_dtype: ValueDtype = "fp32"
    ) -> GroupTopK:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density={density} must be in (0, 1]")
        return cls(group_size, k_for(density, group_size), value_dtype)

    @property
    def density(self) -> float:
        return self.k / self.group_size

    def compress(
        self, x: torch.Tensor, groups: tuple[int, int] | None = None, k: int | None = None
    ) -> SparseGroups:
        """Select top-k per group of flat float32 `x` (optionally groups ``[g0, g1)`` only)."""
        k = self.k if k is None else k
        g = self.group_size
        numel = x.numel()
        g0, g1 = groups if groups is not None else (0, n_groups(numel, g))
        flat = x.reshape(-1)
        if self.value_dtype in ("fp32", "fp16") and 0 < (g1 - g0) * g <= _BLOCK_ENTRIES:
            xn = numpy_view(flat)
            if xn is not None:
                return _compress_small(xn, g, k, g0, g1, self.value_dtype == "fp16")
        rows, idx = _select(flat, g, k, g0, g1)
        values, scales = encode_values(rows, self.value_dtype)
        sign = self.value_dtype == "sign"
        decoded = None
        if not sign:  # +-1 cannot be zeroed; sign keeps the invariant to one rounding
            values, decoded = exactify_decoded(rows, values, scales)
        _, idx_dtype = index_dtype(g)
        return SparseGroups(numel, g, k, g0, idx.to(idx_dtype), values, scales, sign,
                            decoded=decoded, wide_indices=idx)  # fmt: skip


def _select(x: torch.Tensor, g: int, k: int, g0: int, g1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [n, k] and group-local indices [n, k] of the top-k of groups [g0, g1)."""
    if 0 < (g1 - g0) * g <= _BLOCK_ENTRIES:
        return _select_small(x, g, k, g0, g1)
    full_end = min(g1, x.numel() // g)  # groups [g0, full_end) need no padding
    vals: list[torch.Tensor] = []
    idxs: list[torch.Tensor] = []
    if full_end > g0:
        body = x[g0 * g : full_end * g].view(full_end - g0, g)
        step = max(1, _BLOCK_ENTRIES // g)
        for start in range(0, body.shape[0], step):
            block = body[start : start + step]
            i = torch.topk(block.abs(), k, dim=1, sorted=False).indices
            idxs.append(i)
            vals.append(block.gather(1, i))
    if g1 > max(full_end, g0):
        tail = x[max(full_end, g0) * g :]
        padded = torch.zeros(1, g, dtype=x.dtype)
        padded[0, : tail.numel()] = tail
        mags = padded.abs()
        mags[0, tail.numel() :] = -1.0  # padding is chosen only when k > tail length
        i = torch.topk(mags, k, dim=1, sorted=False).indices
        idxs.append(i)
        vals.append(padded.gather(1, i))
    if not idxs:
        return torch.zeros(0, k), torch.zeros(0, k, dtype=torch.int64)
    if len(idxs) == 1:  # one block: no copy
        return vals[0], idxs[0]
    return torch.cat(vals), torch.cat(idxs)


def _select_small(
    x: torch.Tensor, g: int, k: int, g0: int, g1: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_select` for ranges of one block: the padded last group joins the others'
    rows, so a small model's selection is four to six torch calls, not a dozen.
    Every row is selected on its own, as in `_select`: the same entries come out."""
    n = g1 - g0
    seg = x.narrow(0, g0 * g, min(n * g, x.numel() - g0 * g))
    if seg.numel() == n * g:
        rows = seg.view(n, g)
        mags = rows.abs()
    else:
        rows = torch.zeros(n, g, dtype=x.dtype)
        rows.view(-1)[: seg.numel()] = seg
        mags = rows.abs()
        mags.view(-1)[seg.numel() :] = -1.0  # padding is chosen only when k > tail length
    i = torch.topk(mags, k, dim=1, sorted=False).indices
    return rows.gather(1, i), i


_FP16_MAX = np.float32(65504.0)


@lru_cache(maxsize=256)
def _row_ids(n: int) -> np.ndarray:
    ids = np.arange(n)[:, None]
    ids.flags.writeable = False
    return ids


def _compress_small(x: np.ndarray, g: int, k: int, g0: int, g1: int, fp16: bool) -> SparseGroups:
    """`GroupTopK.compress` of a range of one block with fp32 or fp16 values, in numpy
    around one `torch.topk` (the selection, ties included, stays torch's). Every step
    rounds as `_select_small`, `encode_values` and `exactify_decoded` do, so the same
    bits come out (tests/compression/test_small_paths.py) at half the Python cost."""
    n, numel = g1 - g0, x.size
    seg = x[g0 * g : min(g1 * g, numel)]
    if seg.size == n * g:
        rows = seg.reshape(n, g)
        mags = np.abs(rows)
    else:
        rows = np.zeros((n, g), dtype=np.float32)
        rows.reshape(-1)[: seg.size] = seg
        mags = np.abs(rows)
        mags.reshape(-1)[seg.size :] = -1.0  # padding is chosen only when k > tail length
    wide = torch.topk(torch.from_numpy(mags), k, dim=1, sorted=False).indices
    idx = wide.numpy()
    picked = rows[_row_ids(n), idx]
    if fp16:
        # maximum and minimum: clamp's bits (NaN kept) without np.clip's Python wrapper
        values = np.minimum(np.maximum(picked, -_FP16_MAX), _FP16_MAX).astype(np.float16)
        decoded = values.astype(np.float32)
    else:
        values = decoded = picked
    # fp32 values are their own decoding: only Inf and NaN fail the check below
    exact = not fp16 and bool(np.isfinite(picked).all())
    bad = None if exact else (picked - decoded) + decoded != picked
    if bad is not None and bad.any():  # see values.exactify: these stay whole in the residual
        values = np.where(bad, values.dtype.type(0), values)
        decoded = np.where(bad, np.float32(0.0), decoded)
    idx_wire, _ = index_dtype(g)
    narrow = idx.astype(np.uint8 if idx_wire == "u1" else np.uint16)
    indices = from_numpy(narrow, idx_wire)
    return SparseGroups(numel, g, k, g0, indices, torch.from_numpy(values), None, False,
                        decoded=torch.from_numpy(decoded), wide_indices=wide,
                        host=(narrow, values, decoded))  # fmt: skip

"""How `group_topk_hook` turns a bucket into one fixed-size byte tensor and back.

Every rank's payload has the same size (k entries in every group), so the ranks
all-gather flat uint8 tensors. Two codecs fill them, chosen by the working vector:

- CPU float32 (the working precision of every CPU bucket but float64): fedring's
  `GroupTopK` and its checked wire decoder, every value dtype, bit-exact error
  feedback (``sent + residual == compensated``).
- Anything else (CUDA buckets, float64): the same per-group top-k in torch ops on
  the vector's own device, values encoded by the same `encode_values`; "sign"
  values are refused there (their bit packing runs in numpy).

`pack` compresses one rank's vector; the `Packed` it returns subtracts what was
sent from a residual and decodes all ranks' blobs, in rank order, into a mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from fedring.compression.group_topk import GroupTopK
from fedring.compression.payload import PayloadLimits
from fedring.compression.sparse import SparseGroups, n_groups
from fedring.compression.values import decode_values, encode_values, exactify_decoded

_LIMITS = PayloadLimits()


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Compress and keep residuals in float32, or float64 for float64 buckets."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Packed(Protocol):
    """One rank's compressed vector, as the bytes that travel."""

    @property
    def blob(self) -> torch.Tensor:
        """Flat uint8, the same size on every rank."""

    def subtract_sent(self, residual: torch.Tensor) -> None:
        """``residual -= what this rank sent`` (error feedback)."""

    def mean_into(self, blobs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """``out = mean of the ranks' decoded blobs``, summed in rank order."""


def pack(compressor: GroupTopK, x: torch.Tensor) -> Packed:
    """Compress flat `x` (working precision) with `compressor`'s group size, k and values."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        payload = compressor.compress(x)
        blob, layout = _wire_blob(payload)
        return _WirePacked(blob, payload, layout)
    if compressor.value_dtype == "sign":
        raise TypeError(f"value_dtype='sign' needs CPU float32 work vectors, got {x.device} "
                        f"{x.dtype}: use fp32, fp16, bf16 or int8 values")  # fmt: skip
    return _TorchPacked.compress(x, compressor)


# --- CPU float32: fedring's payload and its wire arrays ---------------------------------


@dataclass(frozen=True)
class _Layout:
    """How a packed payload splits into arrays; the same on every rank of a step."""

    meta: dict[str, Any]
    arrays: tuple[tuple[str, str, np.dtype[Any], tuple[int, ...]], ...]


def _wire_blob(payload: SparseGroups) -> tuple[torch.Tensor, _Layout]:
    """The payload's wire arrays (indices, values, scales) back to back, as bytes."""
    meta, arrays = payload.to_wire()
    layout = _Layout(meta, tuple((name, wire, a.dtype, a.shape) for name, wire, a in arrays))
    blob = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                           for _, _, a in arrays])  # fmt: skip
    return torch.from_numpy(blob), layout


def _wire_payload(blob: torch.Tensor, layout: _Layout) -> SparseGroups:
    """Decode another rank's bytes with our own layout through the checked wire decoder."""
    raw = blob.numpy()
    arrays: dict[str, tuple[str, np.ndarray]] = {}
    pos = 0
    for name, wire, dtype, shape in layout.arrays:
        n = int(np.prod(shape)) * dtype.itemsize
        # copy: the slice may sit at an offset not aligned for `dtype`
        arrays[name] = (wire, raw[pos : pos + n].copy().view(dtype).reshape(shape))
        pos += n
    return SparseGroups.from_wire(layout.meta, arrays, _LIMITS)


@dataclass(frozen=True)
class _WirePacked:
    blob: torch.Tensor
    payload: SparseGroups
    layout: _Layout

    def subtract_sent(self, residual: torch.Tensor) -> None:
        self.payload.add_to(residual, alpha=-1.0)

    def mean_into(self, blobs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        out.zero_()
        for blob in blobs:
            _wire_payload(blob, self.layout).add_to(out)
        out.div_(len(blobs))


# --- any device, float32 or float64: torch ops where the bucket lives --------------------


@dataclass(frozen=True)
class _TorchPacked:
    """Bytes: int8 scales (float32, one a group), values, then group-local indices
    (uint8 up to 256 a group, else the low 16 bits as int16): widest first, so
    every part starts aligned for its dtype."""

    blob: torch.Tensor
    numel: int
    group_size: int
    positions: torch.Tensor  # flat positions of the kept entries, clamped into [0, numel)
    decoded: torch.Tensor  # what they decode to, in the working precision
    parts: tuple[tuple[torch.dtype, int], ...]  # (dtype, count) of scales?, values, indices

    @classmethod
    def compress(cls, x: torch.Tensor, c: GroupTopK) -> _TorchPacked:
        g, k, numel = c.group_size, c.k, x.numel()
        n = n_groups(numel, g)
        rows = x.new_zeros(n * g)
        rows[:numel] = x
        mags = rows.abs()
        mags[numel:] = -1.0  # padding is chosen only when k > tail length
        idx = torch.topk(mags.view(n, g), k, dim=1, sorted=False).indices
        picked = rows.view(n, g).gather(1, idx)
        values, scales = encode_values(picked.to(torch.float32), c.value_dtype)
        values, decoded = exactify_decoded(picked, values, scales)  # residuals stay exact
        narrow = idx.to(torch.uint8 if g <= 256 else torch.int16)
        tensors = ([] if scales is None else [scales]) + [values, narrow]
        blob = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
        starts = torch.arange(n, device=x.device)[:, None] * g
        # padding decodes to exactly 0, so clamping its positions adds nothing anywhere
        positions = (starts + idx).reshape(-1).clamp_(max=numel - 1)
        parts = tuple((t.dtype, t.numel()) for t in tensors)
        return cls(blob, numel, g, positions, decoded.to(x.dtype).reshape(-1), parts)

    def subtract_sent(self, residual: torch.Tensor) -> None:
        residual.index_add_(0, self.positions, self.decoded, alpha=-1)

    def mean_into(self, blobs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        n = n_groups(self.numel, self.group_size)
        total = out.new_zeros(n * self.group_size, dtype=self.decoded.dtype)
        for blob in blobs:  # rank order; positions within one blob never repeat
            idx, values = self._unpack(blob.to(out.device))
            total.view(n, self.group_size).scatter_add_(1, idx, values)
        out.copy_(total[: self.numel].div_(len(blobs)))

    def _unpack(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        views, pos = [], 0
        for dtype, count in self.parts:
            nbytes = count * dtype.itemsize
            views.append(blob[pos : pos + nbytes].view(dtype))
            pos += nbytes
        scales = views[0] if len(views) == 3 else None
        values, narrow = views[-2], views[-1]
        idx = narrow.to(torch.int64)
        if narrow.dtype == torch.int16:
            idx = idx & 0xFFFF
        shape = self._shape()
        decoded = decode_values(values.view(shape), scales)
        return idx.view(shape), decoded.to(self.decoded.dtype)

    def _shape(self) -> tuple[int, int]:
        n = n_groups(self.numel, self.group_size)
        return n, self.decoded.numel() // n

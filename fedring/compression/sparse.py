"""Sparse payloads over groups of a flat vector.

The flat vector of `numel` entries is cut into groups of `group_size` (the last one
padded). Indices are group-local: uint8 when G <= 256, uint16 up to 65536, so an
index costs one or two bytes whatever the model size.

- `SparseGroups` ("group-topk"): exactly `k` entries in every group of a range;
  what `GroupTopK` produces and what the `bounded` ring sends.
- `GroupSparse` ("group-sparse"): a variable number of entries per group, CSR
  style; the partial sums of the `exact` ring, whose supports grow by union.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
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
    finite,
    finite_array,
    meta_int,
    meta_range,
    no_extra,
)
from fedring.compression.values import (
    WIRE_DTYPE,
    ValueDtype,
    decode_values,
    dtype_name,
    from_numpy,
    to_numpy,
)

MAX_GROUP_SIZE = 65536


def n_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def pad_rows(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Flat `x` as rows [n, G], the last one zero-padded (a copy only when padded)."""
    rows = n_groups(x.numel(), group_size)
    if rows * group_size != x.numel():
        x = torch.cat([x, x.new_zeros(rows * group_size - x.numel())])
    return x.view(rows, group_size)


def group_header(meta: Mapping[str, Any], limits: PayloadLimits) -> tuple[int, int]:
    """A grouped payload's ``numel`` and ``group_size`` from its wire header, checked
    against `limits`; every grouped codec reads these two first."""
    numel = meta_int(meta, "numel", 1, limits.max_numel)
    g = meta_int(meta, "group_size", 1, min(limits.max_group_size, MAX_GROUP_SIZE))
    return numel, g


def index_dtype(group_size: int) -> tuple[str, torch.dtype]:
    """The narrowest index type for group-local indices."""
    if group_size <= 256:
        return "u1", torch.uint8
    if group_size <= MAX_GROUP_SIZE:
        return "u2", torch.uint16
    raise ValueError(f"group_size {group_size} > {MAX_GROUP_SIZE}")


def _positions(group_ids: torch.Tensor, local: torch.Tensor, group_size: int) -> torch.Tensor:
    return group_ids.to(torch.int64) * group_size + local.to(torch.int64)


@lru_cache(maxsize=1024)
def row_starts(group_start: int, n: int, group_size: int) -> np.ndarray:
    """Flat start [n, 1] (int64) of groups ``[group_start, + n)``; built once per shape,
    read-only, so a round's hops share it."""
    starts = (np.arange(group_start, group_start + n, dtype=np.int64) * group_size)[:, None]
    starts.flags.writeable = False
    return starts


def numpy_view(t: torch.Tensor) -> np.ndarray | None:
    """`t`'s memory as numpy, when `t` is a plain contiguous CPU float32 tensor (None else).

    The hot paths of small payloads run in numpy: one call costs about a third of a
    torch call on tensors of a few hundred entries, and float32 arithmetic rounds the same.
    """
    if t.dtype != torch.float32 or t.requires_grad or not t.is_contiguous() or t.is_cuda:
        return None
    return t.numpy()


def _scatter_add(out: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor, alpha: float) -> None:
    keep = pos < out.numel()  # padding of the last group
    if not bool(keep.all()):
        pos, vals = pos[keep], vals[keep]
    out.index_add_(0, pos, vals, alpha=alpha)


@dataclass(frozen=True, eq=False)
class SparseGroups:
    """Exactly `k` entries per group for groups ``[group_start, group_start + n)``."""

    codec_id: ClassVar[str] = "group-topk"
    numel: int
    group_size: int
    k: int
    group_start: int
    indices: torch.Tensor  # [n, k] uint8 or uint16, group-local
    values: torch.Tensor  # [n, k] float32, float16, bfloat16 or int8 (+-1 when `sign`)
    scales: torch.Tensor | None = None  # [n] float32, with int8 and sign values
    sign: bool = False  # values are +-1 times the scale; one bit each on the wire
    # What the compressor had at hand, kept so that adding the payload does not
    # convert again: decode_values(values, scales), and the indices as int64.
    decoded: torch.Tensor | None = field(default=None, repr=False)
    wide_indices: torch.Tensor | None = field(default=None, repr=False)
    # The same as numpy arrays (indices, values, decoded), from the small-range
    # compressor and from the wire, for `add_to` and `to_wire` without conversions.
    host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return int(self.indices.shape[0])

    @property
    def value_dtype(self) -> ValueDtype:
        return "sign" if self.sign else dtype_name(self.values)

    @property
    def wire_nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * 4
        if self.sign:
            values = -(-self.values.numel() // 8)
        else:
            values = self.values.numel() * self.values.element_size()
        return self.indices.numel() * self.indices.element_size() + values + scales

    def positions(self) -> torch.Tensor:
        """Flat positions [n*k] (int64); may point past `numel` in the padded tail."""
        groups = torch.arange(self.group_start, self.group_start + self.n)
        return _positions(groups[:, None], self.indices, self.group_size).reshape(-1)

    def rows(self, g0: int, g1: int) -> SparseGroups:
        """The payload of groups ``[g0, g1)`` alone (views of this one's memory)."""
        a, b = g0 - self.group_start, g1 - self.group_start
        if not 0 <= a <= b <= self.n:
            raise ValueError(f"groups [{g0}, {g1}) are not inside {self.group_start} + {self.n}")

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[a:b]

        h = self.host
        host = None if h is None else (h[0][a:b], h[1][a:b], h[2][a:b])
        return SparseGroups(
            self.numel, self.group_size, self.k, g0, self.indices[a:b], self.values[a:b],
            cut(self.scales), self.sign, decoded=cut(self.decoded),
            wide_indices=cut(self.wide_indices), host=host,
        )  # fmt: skip

    def dense_values(self) -> torch.Tensor:
        return self._decoded().reshape(-1)

    def _decoded(self) -> torch.Tensor:
        return self.decoded if self.decoded is not None else decode_values(self.values, self.scales)

    def _numpy_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """Indices [n, k] and float32 decoded values [n, k] as numpy."""
        if self.host is not None:
            return self.host[0], self.host[2]
        wide = self.wide_indices
        idx = wide.numpy() if wide is not None else to_numpy(self.indices)
        if self.decoded is not None:
            vals = self.decoded.numpy()
        elif self.values.dtype == torch.float32:
            vals = self.values.numpy()
        elif self.values.dtype == torch.float16:
            vals = self.values.numpy().astype(np.float32)  # exact, as .to(torch.float32)
        else:
            vals = decode_values(self.values, self.scales).numpy()
        return idx, vals

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> None:
        # np.add.at adds in order, repeats included, as index_add_ does; float32 sums
        # round the same, and `vals * alpha` is rounded to float32 first, as index_add_
        # does with alpha. Outputs numpy cannot view take index_add_ itself.
        o = numpy_view(out)
        if o is None:
            _scatter_add(out, self.positions(), self.dense_values(), alpha)
            return
        n, g = self.n, self.group_size
        idx, vals = self._numpy_parts()
        if alpha != 1.0:
            vals = vals * np.float32(alpha)
        pos = row_starts(self.group_start, n, g) + idx
        if (self.group_start + n) * g > self.numel:  # the padded last group: drop its padding
            keep = pos < self.numel
            if not keep.all():
                pos, vals = pos[keep], vals[keep]
        np.add.at(o, pos, vals)

    def decompress(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        self.add_to(out)
        return out

    def to_wire(self) -> tuple[dict[str, Any], WireArrays]:
        vdtype = self.value_dtype
        meta: dict[str, Any] = {
            "codec": self.codec_id,
            "numel": self.numel,
            "group_size": self.group_size,
            "k": self.k,
            "groups": [self.group_start, self.group_start + self.n],
        }
        idx_wire, _ = index_dtype(self.group_size)
        if self.sign:
            meta["vdtype"] = "sign"
            values = np.packbits(to_numpy(self.values).reshape(-1) > 0)
        else:
            values = to_numpy(self.values) if self.host is None else self.host[1]
        arrays: WireArrays = [
            ("idx", idx_wire, to_numpy(self.indices) if self.host is None else self.host[0]),
            ("val", WIRE_DTYPE[vdtype], values),
        ]
        if self.scales is not None:
            arrays.append(("scale", "f4", to_numpy(self.scales)))
        return meta, arrays

    @classmethod
    def from_wire(
        cls, meta: Mapping[str, Any], arrays: Decoded, limits: PayloadLimits
    ) -> SparseGroups:
        numel, g = group_header(meta, limits)
        k = meta_int(meta, "k", 1, g)
        g0, g1 = meta_range(meta, "groups", n_groups(numel, g))
        n = g1 - g0
        idx_wire, _ = index_dtype(g)
        _, idx = array(arrays, "idx", (idx_wire,), (n, k))
        if meta.get("vdtype", "sign") != "sign":
            raise PayloadError(PayloadReason.BAD_DTYPE, f"vdtype {meta.get('vdtype')!r:.20}")
        sign = meta.get("vdtype") == "sign"
        if sign:
            _, bits = array(arrays, "val", ("u1",), (-(-(n * k) // 8),))
            signs = np.unpackbits(bits, count=n * k).astype(np.int8) * 2 - 1
            vdt, val = "i1", signs.reshape(n, k)
        else:
            vdt, val = array(arrays, "val", ("f4", "f2", "bf16", "i1"), (n, k))
        names = {"idx", "val"}
        scales = None
        if vdt == "i1":
            _, sc = array(arrays, "scale", ("f4",), (n,))
            scales = torch.from_numpy(sc)
            finite(scales, "int8 scales")
            names.add("scale")
        no_extra(arrays, names)
        indices = from_numpy(idx, idx_wire)
        # uint8 indices cannot reach a group of 256 or more, nor uint16 one of 65536
        if n and g < (256 if idx_wire == "u1" else 65536) and int(idx.max()) >= g:
            raise PayloadError(
                PayloadReason.INDEX_OUT_OF_RANGE, f"index {int(idx.max())} >= group size {g}"
            )
        if vdt in ("f4", "f2"):  # float32 decodes as itself, float16 exactly by astype
            decoded = val if vdt == "f4" else val.astype(np.float32)
            finite_array(decoded, "values")  # Inf and NaN survive the widening
            values = from_numpy(val, vdt)
            return cls(numel, g, k, g0, indices, values, host=(idx, val, decoded))
        values = from_numpy(val, vdt)
        finite(values, "values")
        return cls(numel, g, k, g0, indices, values, scales, sign)


@dataclass(frozen=True, eq=False)
class GroupSparse:
    """A variable number of entries per group for groups ``[group_start, + n)``."""

    codec_id: ClassVar[str] = "group-sparse"
    numel: int
    group_size: int
    group_start: int
    counts: torch.Tensor  # [n] entries in each group
    indices: torch.Tensor  # [nnz] group-local, grouped in group order
    values: torch.Tensor  # [nnz] float32

    @property
    def n(self) -> int:
        return int(self.counts.shape[0])

    @property
    def wire_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.counts, self.indices, self.values))

    @classmethod
    def from_dense(cls, x: torch.Tensor, group_size: int, groups: tuple[int, int]) -> GroupSparse:
        """The non-zeros of `x` in groups ``[g0, g1)``; zeros add nothing to a sum."""
        g0, g1 = groups
        start = g0 * group_size
        seg = x[start : min(g1 * group_size, x.numel())]
        nz = torch.nonzero(seg).reshape(-1)
        group_ids = torch.div(nz, group_size, rounding_mode="floor")
        counts = torch.bincount(group_ids, minlength=g1 - g0)
        _, idx_dtype = index_dtype(group_size)
        local = (nz - group_ids * group_size).to(idx_dtype)
        count_max = int(counts.max()) if counts.numel() else 0
        count_dtype = torch.uint8 if count_max <= 255 else torch.int32
        return cls(x.numel(), group_size, g0, counts.to(count_dtype), local, seg[nz].clone())

    def positions(self) -> torch.Tensor:
        groups = torch.arange(self.group_start, self.group_start + self.n)
        group_ids = torch.repeat_interleave(groups, self.counts.to(torch.int64))
        return _positions(group_ids, self.indices, self.group_size)

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> None:
        _scatter_add(out, self.positions(), self.values, alpha)

    def decompress(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        self.add_to(out)
        return out

    def to_wire(self) -> tuple[dict[str, Any], WireArrays]:
        count_wire = "u1" if self.counts.dtype == torch.uint8 else "i4"
        meta = {
            "codec": self.codec_id,
            "numel": self.numel,
            "group_size": self.group_size,
            "groups": [self.group_start, self.group_start + self.n],
        }
        idx_wire, _ = index_dtype(self.group_size)
        return meta, [
            ("count", count_wire, to_numpy(self.counts)),
            ("idx", idx_wire, to_numpy(self.indices)),
            ("val", "f4", to_numpy(self.values)),
        ]

    @classmethod
    def from_wire(
        cls, meta: Mapping[str, Any], arrays: Decoded, limits: PayloadLimits
    ) -> GroupSparse:
        numel, g = group_header(meta, limits)
        g0, g1 = meta_range(meta, "groups", n_groups(numel, g))
        _, counts = array(arrays, "count", ("u1", "i4"), (g1 - g0,))
        if counts.size and (int(counts.min()) < 0 or int(counts.max()) > g):
            raise PayloadError(PayloadReason.SHAPE_MISMATCH, f"a group count is outside [0, {g}]")
        nnz = int(counts.sum(dtype=np.int64))
        idx_wire, _ = index_dtype(g)
        _, idx = array(arrays, "idx", (idx_wire,), (nnz,))
        _, val = array(arrays, "val", ("f4",), (nnz,))
        no_extra(arrays, {"count", "idx", "val"})
        if nnz and int(idx.max()) >= g:
            raise PayloadError(
                PayloadReason.INDEX_OUT_OF_RANGE, f"index {int(idx.max())} >= group size {g}"
            )
        values = torch.from_numpy(val)
        finite(values, "values")
        return cls(numel, g, g0, torch.from_numpy(counts), from_numpy(idx, idx_wire), values)

"""Dense quantizers and the dense payloads they produce.

- `DenseCodec` ("dense"): a contiguous range of the flat vector as fp32, fp16 or
  bf16, or as small integers (the vote counts of the sign ring).
- `Int8Quantizer` ("int8"): int8 with one float32 scale per group of G entries.
- `SignQuantizer` ("sign"): one bit per entry (packed) and a scale per group,
  ``mean |x|`` of the group, so ``scale * sign`` has the group's L1 mass
  (EF-signSGD, Karimireddy et al. 2019). An optional second bit plane marks
  non-zeros, for results that can be 0 (a tied majority vote).

The same value encodings serve top-k values (see `values.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedring.compression.payload import (
    Decoded,
    PayloadLimits,
    WireArrays,
    array,
    finite,
    meta_int,
    meta_range,
    no_extra,
)
from fedring.compression.sparse import pad_rows
from fedring.compression.values import (
    ValueDtype,
    check_value_dtype,
    encode_values,
    from_numpy,
    to_numpy,
)

_FLOAT_WIRE = {torch.float32: "f4", torch.float16: "f2", torch.bfloat16: "bf16"}
_INT_WIRE = {torch.int8: "i1", torch.int16: "i2", torch.int32: "i4"}
_WIRE_ANY = {**_FLOAT_WIRE, **_INT_WIRE}


@dataclass(frozen=True, eq=False)
class DenseChunk:
    """Entries ``[start, start + len(values))`` of a flat vector of `numel`."""

    codec_id: ClassVar[str] = "dense"
    numel: int
    start: int
    values: torch.Tensor  # 1-D float32/float16/bfloat16, or int8/16/32 counts

    @property
    def wire_nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> None:
        out[self.start : self.start + self.values.numel()].add_(
            self.values.to(out.dtype), alpha=alpha
        )

    def decompress(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        self.add_to(out)
        return out

    def to_wire(self) -> tuple[dict[str, Any], WireArrays]:
        meta = {
            "codec": self.codec_id,
            "numel": self.numel,
            "range": [self.start, self.start + self.values.numel()],
        }
        return meta, [("val", _WIRE_ANY[self.values.dtype], to_numpy(self.values))]

    @classmethod
    def from_wire(
        cls, meta: Mapping[str, Any], arrays: Decoded, limits: PayloadLimits
    ) -> DenseChunk:
        numel = meta_int(meta, "numel", 1, limits.max_numel)
        a, b = meta_range(meta, "range", numel)
        dtype, val = array(arrays, "val", tuple(_WIRE_ANY.values()), (b - a,))
        no_extra(arrays, {"val"})
        values = from_numpy(val, dtype)
        finite(values, "values")
        return cls(numel, a, values)


@dataclass(frozen=True, eq=False)
class Int8Groups:
    """Entries ``[start, start + len(q))`` as int8 with a scale per group of G."""

    codec_id: ClassVar[str] = "int8"
    numel: int
    start: int
    group_size: int
    q: torch.Tensor  # [L] int8
    scales: torch.Tensor  # [ceil(L / G)] float32

    @property
    def wire_nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 4

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> None:
        n = self.q.numel()
        rows = pad_rows(self.q.to(torch.float32), self.group_size) * self.scales[:, None]
        out[self.start : self.start + n].add_(rows.reshape(-1)[:n], alpha=alpha)

    def decompress(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        self.add_to(out)
        return out

    def to_wire(self) -> tuple[dict[str, Any], WireArrays]:
        meta = {
            "codec": self.codec_id,
            "numel": self.numel,
            "group_size": self.group_size,
            "range": [self.start, self.start + self.q.numel()],
        }
        return meta, [("q", "i1", to_numpy(self.q)), ("scale", "f4", to_numpy(self.scales))]

    @classmethod
    def from_wire(
        cls, meta: Mapping[str, Any], arrays: Decoded, limits: PayloadLimits
    ) -> Int8Groups:
        numel = meta_int(meta, "numel", 1, limits.max_numel)
        g = meta_int(meta, "group_size", 1, limits.max_group_size)
        a, b = meta_range(meta, "range", numel)
        _, q = array(arrays, "q", ("i1",), (b - a,))
        _, sc = array(arrays, "scale", ("f4",), (-(-(b - a) // g),))
        no_extra(arrays, {"q", "scale"})
        scales = torch.from_numpy(sc)
        finite(scales, "int8 scales")
        return cls(numel, a, g, torch.from_numpy(q), scales)


@dataclass(frozen=True, eq=False)
class SignBits:
    """Entries ``[start, start + length)`` as packed sign bits times a group scale."""

    codec_id: ClassVar[str] = "sign"
    numel: int
    start: int
    length: int
    group_size: int
    positive: np.ndarray  # packed bits: 1 where the entry is > 0
    scales: torch.Tensor | None  # [ceil(length / G)] float32, or None for unit scale
    nonzero: np.ndarray | None = None  # packed bits: 1 where the entry is not 0

    @property
    def wire_nbytes(self) -> int:
        planes = self.positive.size + (0 if self.nonzero is None else self.nonzero.size)
        return planes + (0 if self.scales is None else self.scales.numel() * 4)

    def signs(self) -> torch.Tensor:
        """The entries' signs as int8 in {-1, 0, 1} (0 only with a non-zero plane)."""
        pos = np.unpackbits(self.positive, count=self.length).astype(np.int8)
        s = torch.from_numpy(pos * 2 - 1)
        if self.nonzero is not None:
            s = s * torch.from_numpy(np.unpackbits(self.nonzero, count=self.length).astype(np.int8))
        return s

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> None:
        vals = self.signs().to(torch.float32)
        if self.scales is not None:
            vals = (pad_rows(vals, self.group_size) * self.scales[:, None]).reshape(-1)[
                : self.length
            ]
        out[self.start : self.start + self.length].add_(vals, alpha=alpha)

    def decompress(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        self.add_to(out)
        return out

    def to_wire(self) -> tuple[dict[str, Any], WireArrays]:
        meta = {
            "codec": self.codec_id,
            "numel": self.numel,
            "group_size": self.group_size,
            "range": [self.start, self.start + self.length],
        }
        arrays: WireArrays = [("pos", "u1", self.positive)]
        if self.nonzero is not None:
            arrays.append(("nz", "u1", self.nonzero))
        if self.scales is not None:
            arrays.append(("scale", "f4", to_numpy(self.scales)))
        return meta, arrays

    @classmethod
    def from_wire(cls, meta: Mapping[str, Any], arrays: Decoded, limits: PayloadLimits) -> SignBits:
        numel = meta_int(meta, "numel", 1, limits.max_numel)
        g = meta_int(meta, "group_size", 1, limits.max_group_size)
        a, b = meta_range(meta, "range", numel)
        nbytes = -(-(b - a) // 8)
        _, pos = array(arrays, "pos", ("u1",), (nbytes,))
        nz = array(arrays, "nz", ("u1",), (nbytes,))[1] if "nz" in arrays else None
        scales = None
        if "scale" in arrays:
            scales = torch.from_numpy(array(arrays, "scale", ("f4",), (-(-(b - a) // g),))[1])
            finite(scales, "sign scales")
        no_extra(arrays, {"pos", "nz", "scale"})
        return cls(numel, a, b - a, g, pos, scales, nz)

    @classmethod
    def from_signs(cls, signs: torch.Tensor, numel: int, start: int) -> SignBits:
        """Unit-scale three-state signs (values in {-1, 0, 1})."""
        s = signs.numpy()
        return cls(numel, start, s.size, 1, np.packbits(s > 0), None, np.packbits(s != 0))


@dataclass(frozen=True)
class DenseCodec:
    """No sparsification; values sent as fp32 (the baseline), fp16 or bf16."""

    codec_id = "dense"
    value_dtype: ValueDtype = "fp32"

    def __post_init__(self) -> None:
        if check_value_dtype(self.value_dtype) in ("int8", "sign"):
            raise ValueError("use Int8Quantizer or SignQuantizer for int8 or sign dense values")

    def compress(self, x: torch.Tensor) -> DenseChunk:
        values, _ = encode_values(x.reshape(1, -1), self.value_dtype)
        return DenseChunk(x.numel(), 0, values.reshape(-1))


@dataclass(frozen=True)
class Int8Quantizer:
    """int8 with one float32 scale (max |x| / 127) per group of `group_size`."""

    codec_id = "int8"
    group_size: int = 256

    def compress(self, x: torch.Tensor) -> Int8Groups:
        q, scales = encode_values(pad_rows(x.reshape(-1), self.group_size), "int8")
        if scales is None:  # encode_values always scales int8; this guards a refactor
            raise RuntimeError("int8 encoding returned no scales")
        return Int8Groups(x.numel(), 0, self.group_size, q.reshape(-1)[: x.numel()].clone(), scales)


@dataclass(frozen=True)
class SignQuantizer:
    """One bit per entry plus the group's mean |x| (EF-signSGD); pair with feedback."""

    codec_id = "sign"
    group_size: int = 4096

    def compress(self, x: torch.Tensor) -> SignBits:
        flat = x.reshape(-1)
        # Pad with zeros for the mean, but divide by the real length of each group.
        sums = pad_rows(flat.abs(), self.group_size).sum(dim=1)
        lengths = torch.full_like(sums, float(self.group_size))
        lengths[-1] = flat.numel() - (sums.numel() - 1) * self.group_size
        positive = np.packbits((flat > 0).numpy())
        return SignBits(flat.numel(), 0, flat.numel(), self.group_size, positive, sums / lengths)

"""What every compressed value can do, and the checks shared by their decoders.

A payload describes itself: its codec id and sizes travel in `meta`, its arrays
beside it as named numpy arrays (laid out in a frame body by whoever frames it;
see `fedring.collective.payloads`). A receiver never needs its own shapes to
decode one, only limits to refuse absurd ones. Payloads cover either a whole flat
vector of `numel` entries or a contiguous range of it (a ring chunk).

Nothing here knows frames: a payload that does not add up raises `PayloadError`,
whose `PayloadReason` values are a subset of the wire's `FrameReason` values, so
the layer that frames payloads turns one into the other without a table to keep.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

WireArrays = list[tuple[str, str, np.ndarray]]
Decoded = Mapping[str, tuple[str, np.ndarray]]


class PayloadReason(StrEnum):
    """Why a payload was refused; each value is also a `fedring.wire.FrameReason`."""

    UNKNOWN_CODEC = "unknown_codec"
    BAD_DTYPE = "bad_dtype"  # not what the codec needs
    SHAPE_MISMATCH = "shape_mismatch"  # meta, arrays and limits disagree
    INDEX_OUT_OF_RANGE = "index_out_of_range"  # group-local index >= group size
    NON_FINITE = "non_finite"  # NaN or Inf in transmitted values


class PayloadError(ValueError):
    """A payload's meta or arrays were refused; `reason` says why, `detail` says where."""

    def __init__(self, reason: PayloadReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class PayloadLimits:
    """What a receiver accepts; set from the job's manifest."""

    max_numel: int = 1 << 30
    max_group_size: int = 65536

    @property
    def max_elements(self) -> int:
        """The most entries one array may declare before anything is allocated."""
        # k entries of the zero-padded last group may exceed numel by up to one group.
        return self.max_numel + self.max_group_size


@runtime_checkable
class Payload(Protocol):
    codec_id: ClassVar[str]

    @property
    def numel(self) -> int:
        """Length of the whole flat vector this payload belongs to."""
        ...

    @property
    def wire_nbytes(self) -> int:
        """Bytes of the arrays as they go in a body (without padding or header)."""
        ...

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> None:
        """Add this payload (times `alpha`) into the flat float32 vector `out`."""
        ...

    def decompress(self) -> torch.Tensor:
        """A new flat float32 vector of length `numel`."""
        ...

    def to_wire(self) -> tuple[dict[str, Any], WireArrays]:
        """Meta (codec id, sizes) and the arrays to put in a body."""
        ...

    @classmethod
    def from_wire(cls, meta: Mapping[str, Any], arrays: Decoded, limits: PayloadLimits) -> Any:
        """Validate and build; raise `PayloadError` on anything inconsistent."""
        ...


class Compressor(Protocol):
    """Turns a flat float32 vector into a payload."""

    codec_id: str

    def compress(self, x: torch.Tensor) -> Payload: ...


def meta_int(meta: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = meta.get(name)
    if type(value) is not int or not low <= value <= high:
        raise PayloadError(
            PayloadReason.SHAPE_MISMATCH, f"meta {name!r}={value!r:.40} not in [{low}, {high}]"
        )
    return value


def meta_range(meta: Mapping[str, Any], name: str, high: int) -> tuple[int, int]:
    value = meta.get(name)
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(type(v) is int for v in value)
        and 0 <= value[0] <= value[1] <= high
    ):
        raise PayloadError(
            PayloadReason.SHAPE_MISMATCH, f"meta {name!r}={value!r:.60} not a range in [0, {high}]"
        )
    return value[0], value[1]


def array(
    arrays: Decoded, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]
) -> tuple[str, np.ndarray]:
    """The array `name`, checked for dtype and exact shape."""
    if name not in arrays:
        raise PayloadError(PayloadReason.SHAPE_MISMATCH, f"array {name!r} is missing")
    dtype, a = arrays[name]
    if dtype not in dtypes:
        raise PayloadError(
            PayloadReason.BAD_DTYPE, f"array {name!r} is {dtype}, expected one of {dtypes}"
        )
    if a.shape != shape:
        raise PayloadError(
            PayloadReason.SHAPE_MISMATCH, f"array {name!r} has shape {a.shape}, expected {shape}"
        )
    return dtype, a


def no_extra(arrays: Decoded, names: set[str]) -> None:
    extra = set(arrays) - names
    if extra:
        raise PayloadError(PayloadReason.SHAPE_MISMATCH, f"unexpected array {sorted(extra)[0]!r}")


def finite_array(a: np.ndarray, what: str) -> None:
    """`finite` for a numpy float array."""
    if not np.isfinite(a).all():
        raise PayloadError(PayloadReason.NON_FINITE, f"{what} holds NaN or Inf")


def finite(t: torch.Tensor, what: str) -> None:
    if t.dtype in (torch.float32, torch.float16):  # numpy: a third of torch's cost per call
        ok = bool(np.isfinite(t.numpy()).all())
    else:
        ok = not t.is_floating_point() or bool(torch.isfinite(t).all())
    if not ok:
        raise PayloadError(PayloadReason.NON_FINITE, f"{what} holds NaN or Inf")

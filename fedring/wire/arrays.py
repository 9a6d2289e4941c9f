"""Numeric arrays inside a frame body, described by a small spec in `meta`.

A payload is a few named 1-D or 2-D arrays laid end to end in the body, each
starting on a 4-byte boundary. The spec is a map ``{name: [dtype, *dims]}`` in body
order. Unpacking checks every dtype against an allow-list and the sum of the
declared sizes against the body length *before* creating any array, then returns
zero-copy views. Nothing here knows what the arrays mean; codecs do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedring.wire.errors import FrameError, FrameReason

# bf16 has no numpy dtype: it travels as its raw 16-bit patterns.
DTYPES: Mapping[str, np.dtype[Any]] = {
    "u1": np.dtype(np.uint8),
    "u2": np.dtype(np.uint16),
    "i1": np.dtype(np.int8),
    "i2": np.dtype(np.int16),
    "i4": np.dtype(np.int32),
    "f2": np.dtype(np.float16),
    "bf16": np.dtype(np.uint16),
    "f4": np.dtype(np.float32),
}
_ALIGN = 4
_MAX_ARRAYS = 8
_MAX_NDIM = 2


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def pack_arrays(
    arrays: Sequence[tuple[str, str, np.ndarray]],
) -> tuple[dict[str, list[Any]], bytes]:
    """Lay out `(name, dtype, array)` triples; return the spec and the body bytes."""
    spec: dict[str, list[Any]] = {}
    pieces: list[bytes] = []
    offset = 0
    for name, dtype, array in arrays:
        if dtype not in DTYPES or array.dtype != DTYPES[dtype]:
            raise ValueError(f"array {name!r}: dtype {array.dtype} does not match {dtype!r}")
        if array.ndim > _MAX_NDIM:
            raise ValueError(f"array {name!r} has {array.ndim} dims; at most {_MAX_NDIM}")
        start = _aligned(offset)
        if start > offset:
            pieces.append(b"\x00" * (start - offset))
        data = np.ascontiguousarray(array).tobytes()
        pieces.append(data)
        offset = start + len(data)
        spec[name] = [dtype, *(int(d) for d in array.shape)]
    return spec, b"".join(pieces)


def unpack_arrays(
    spec: Any, body: bytes | bytearray, *, max_elements: int
) -> dict[str, tuple[str, np.ndarray]]:
    """Validate `spec` against `body`; return ``{name: (dtype, view)}`` in body order.

    Views share `body`'s memory; pass a `bytearray` to get writable arrays.
    """
    if not isinstance(spec, dict) or not 0 < len(spec) <= _MAX_ARRAYS:
        raise FrameError(FrameReason.MALFORMED, "meta 'arrays' must map 1..8 names to specs")
    layout: list[tuple[str, str, tuple[int, ...], int]] = []
    offset = 0
    for name, entry in spec.items():
        dtype, shape = _entry(name, entry, max_elements)
        start = _aligned(offset)
        count = math.prod(shape)  # exact Python ints; np.prod costs ~5 us a call
        layout.append((name, dtype, shape, start))
        offset = start + count * DTYPES[dtype].itemsize
    if offset != len(body):
        raise FrameError(
            FrameReason.SHAPE_MISMATCH, f"arrays declare {offset} bytes, body has {len(body)}"
        )
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, dtype, shape, start in layout:
        count = math.prod(shape)
        view = np.frombuffer(body, dtype=DTYPES[dtype], count=count, offset=start)
        out[name] = (dtype, view.reshape(shape))
    return out


def _entry(name: str, entry: Any, max_elements: int) -> tuple[str, tuple[int, ...]]:
    if not isinstance(entry, list) or not entry:
        raise FrameError(
            FrameReason.MALFORMED, f"array {name!r}: spec {entry!r:.60} is not [dtype, *dims]"
        )
    dtype, dims = entry[0], entry[1:]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FrameError(FrameReason.BAD_DTYPE, f"array {name!r}: dtype {dtype!r:.20} not allowed")
    if len(dims) > _MAX_NDIM or not all(type(d) is int and 0 <= d <= max_elements for d in dims):
        raise FrameError(FrameReason.SHAPE_MISMATCH, f"array {name!r}: dims {dims!r:.60}")
    count = 1
    for d in dims:
        count *= d
    if count > max_elements:
        raise FrameError(
            FrameReason.OVERSIZE, f"array {name!r}: {count} elements > limit {max_elements}"
        )
    return dtype, tuple(dims)

"""A checkpoint patch: the float32 entries of one slice of a flat vector that changed.

A ring member sends the coordinator, every checkpoint round, the entries of its
slice ``[lo, hi)`` of the parameters that differ (bit for bit) from the last
checkpoint's; the coordinator writes them into its copy and has the new model
exactly (`coordinator.replica`). After a sparse round only a few entries move, so
a patch lists them, then their float32 values, with the smallest index form:

- ``g1``: the slice in groups of 256 entries, a byte a group for how many changed
  and a byte each for where (``n + ceil((hi - lo) / 256)`` bytes of indices);
- ``u2`` / ``i4``: each index from ``lo`` in 2 bytes (slices up to 65,536) or 4;
- ``dense``: where most entries moved (a dense update, momentum), the whole slice
  in float32: never more than 4 bytes an entry.

The values are the parameters themselves, so nothing is rounded: a top-k update
moves each entry it touches by far more than its last 16 mantissa bits (measured
on digits: 0.3% of the changed entries would fit an XOR of 16 bits).

    >>> import numpy as np
    >>> old = np.zeros(6, dtype=np.float32); new = old.copy(); new[4] = 1.5
    >>> doc, blob = encode_patch(old, new, lo=10)
    >>> doc, len(blob)
    ({'lo': 10, 'hi': 16, 'n': 1, 'index': 'u2'}, 6)
    >>> target = np.zeros(20, dtype=np.float32)
    >>> apply_patch(target, doc, blob); float(target[14])
    1.5
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedring.wire.errors import FrameError, FrameReason

GROUP = 256  # entries a group in the ``g1`` form: its indices fit a byte
_INDEX: dict[str, np.dtype[Any]] = {"u2": np.dtype("<u2"), "i4": np.dtype("<i4")}
_VALUE = np.dtype("<f4")


def encode_patch(old: np.ndarray, new: np.ndarray, *, lo: int) -> tuple[dict[str, Any], bytes]:
    """The patch turning slice `old` into `new` (float32, same length), placed at `lo`."""
    if old.shape != new.shape or old.dtype != np.float32 or new.dtype != np.float32:
        raise ValueError(f"slices of {old.shape}/{old.dtype} and {new.shape}/{new.dtype}")
    changed = np.flatnonzero(old.view(np.uint32) != new.view(np.uint32))  # bits, NaN too
    return encode_changed(new, changed, lo=lo)


def encode_changed(
    new: np.ndarray, changed: np.ndarray, *, lo: int
) -> tuple[dict[str, Any], bytes]:
    """The patch writing `new` at `changed` (increasing indices into `new`, float32):
    `encode_patch` where the caller already knows which entries moved (an asynchronous
    centre, `engine.async_reply`)."""
    size = int(new.size)
    n = len(changed)
    doc: dict[str, Any] = {"lo": lo, "hi": lo + size}
    counts = np.bincount(changed // GROUP, minlength=-(-size // GROUP))
    wide = "u2" if size <= 1 << 16 else "i4"
    forms = {"dense": 4 * size, wide: n * (_INDEX[wide].itemsize + 4)}
    if not n or int(counts.max()) < GROUP:  # a whole group changed: a count of 256
        forms["g1"] = len(counts) + 5 * n
    index = min(forms, key=lambda f: (forms[f], f != "dense"))  # a tie: dense, simplest
    if index == "dense":
        return {**doc, "n": size, "index": "dense"}, new.astype(_VALUE).tobytes()
    values = new[changed].astype(_VALUE).tobytes()
    if index == "g1":
        where = (changed % GROUP).astype(np.uint8)
        return {**doc, "n": n, "index": "g1"}, (
            counts.astype(np.uint8).tobytes() + where.tobytes() + values
        )
    return {**doc, "n": n, "index": index}, changed.astype(_INDEX[index]).tobytes() + values


def apply_patch(target: np.ndarray, doc: dict[str, Any], blob: bytes) -> None:
    """Write the patch into `target` (the whole flat float32 vector), after checking
    every field against it: a malformed patch raises `FrameError` naming the field
    and changes nothing."""
    lo, hi, n, index = (doc.get(k) for k in ("lo", "hi", "n", "index"))
    size = int(target.size)
    if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi <= size:
        raise FrameError(FrameReason.SHAPE_MISMATCH,
                         f"patch slice lo={lo!r:.20} hi={hi!r:.20} of {size} entries")  # fmt: skip
    if type(n) is not int or not 0 <= n <= hi - lo:
        raise FrameError(FrameReason.SHAPE_MISMATCH, f"patch n={n!r:.20} for {hi - lo} entries")
    if index == "dense":
        if n != hi - lo or len(blob) != 4 * n:
            raise FrameError(FrameReason.SHAPE_MISMATCH,
                             f"dense patch of {len(blob)} bytes for {hi - lo} entries")  # fmt: skip
        target[lo:hi] = np.frombuffer(blob, dtype=_VALUE)
        return
    at, offset = _positions(index, n, hi - lo, blob)
    if n and (at[0] < 0 or at[-1] >= hi - lo or bool(np.any(np.diff(at) <= 0))):
        raise FrameError(FrameReason.INDEX_OUT_OF_RANGE,
                         f"patch indices not increasing within [0, {hi - lo})")  # fmt: skip
    target[lo + at] = np.frombuffer(blob, dtype=_VALUE, count=n, offset=offset)


def _positions(index: Any, n: int, size: int, blob: bytes) -> tuple[np.ndarray, int]:
    """The patch's indices from the slice's start, and where its values begin."""
    if index == "g1":
        groups = -(-size // GROUP)
        if len(blob) != groups + 5 * n:
            raise FrameError(FrameReason.SHAPE_MISMATCH,
                             f"g1 patch of {len(blob)} bytes for {n} entries in "
                             f"{groups} groups")  # fmt: skip
        counts = np.frombuffer(blob, dtype=np.uint8, count=groups).astype(np.int64)
        if int(counts.sum()) != n:
            raise FrameError(FrameReason.SHAPE_MISMATCH,
                             f"g1 patch counts sum to {int(counts.sum())}, n={n}")  # fmt: skip
        where = np.frombuffer(blob, dtype=np.uint8, count=n, offset=groups).astype(np.int64)
        return np.repeat(np.arange(groups) * GROUP, counts) + where, groups + n
    if index not in _INDEX:
        raise FrameError(FrameReason.BAD_DTYPE, f"patch index={index!r:.20}: g1, u2, i4 or dense")
    width = _INDEX[index].itemsize
    if len(blob) != n * (width + 4):
        raise FrameError(FrameReason.SHAPE_MISMATCH,
                         f"patch of {len(blob)} bytes for {n} entries of {width} + 4")  # fmt: skip
    return np.frombuffer(blob, dtype=_INDEX[index], count=n).astype(np.int64), n * width

"""What a protocol agent sends that must pass for a real member's: its update, a ring's
chunk, its parameters' hash (`fedring.lab.loadgen`), all without torch.

    >>> meta, body = star_payload(1000, 256, 3, "fp16")
    >>> meta["codec"], meta["groups"], len(body)
    ('group-topk', [0, 4], 36)
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from fedring.wire.arrays import pack_arrays

_WIRE = {"fp32": ("f4", np.float32), "fp16": ("f2", np.float16)}


def star_payload(
    numel: int, group_size: int, k: int, value_dtype: str
) -> tuple[dict[str, Any], bytes]:
    """A group-top-k update of `numel` entries as its wire meta and body, the size a real
    member sends (`compression.sparse.SparseGroups.to_wire`): k indices and k values a
    group. Values are zero, so the centre's mean does not move the model."""
    return sparse_chunk(numel, group_size, k, value_dtype, (0, -(-numel // group_size)))


def sparse_chunk(
    numel: int, group_size: int, k: int, value_dtype: str, span: tuple[int, int]
) -> tuple[dict[str, Any], bytes]:
    """Groups ``span`` of a group-top-k payload of `numel` entries (a ring's chunk under
    the ``bounded`` policy: k entries a group at every hop), as its wire meta and body.

    >>> meta, body = sparse_chunk(12_740, 256, 3, "fp16", (8, 16))
    >>> meta["groups"], len(body)
    ([8, 16], 72)
    """
    if value_dtype not in _WIRE:
        raise ValueError(f"value_dtype={value_dtype!r}: the load generator sends fp32 or fp16")
    n = span[1] - span[0]
    idx = np.tile(np.arange(k, dtype=np.uint8 if group_size <= 256 else np.uint16), (n, 1))
    wire, dtype = _WIRE[value_dtype]
    meta = {"codec": "group-topk", "numel": numel, "group_size": group_size, "k": k,
            "groups": [span[0], span[1]]}  # fmt: skip
    spec, body = pack_arrays([("idx", "u1" if group_size <= 256 else "u2", idx),
                              ("val", wire, np.zeros((n, k), dtype=dtype))])  # fmt: skip
    meta["arrays"] = spec
    return meta, body


def chunk_bounds(units: int, world: int) -> list[tuple[int, int]]:
    """The ring's chunks: ``range(units)`` cut into `world` nearly equal ranges, as
    `collective.ring.chunk_bounds` (which imports torch) cuts them.

    >>> chunk_bounds(5, 3)
    [(0, 1), (1, 3), (3, 5)]
    """
    return [(i * units // world, (i + 1) * units // world) for i in range(world)]


class Params:
    """Every agent's parameters at round r: all entries equal to r (float32), with their
    sha256 computed once a round for the whole fleet."""

    def __init__(self) -> None:
        self.numel = 0
        self._sha: dict[int, str] = {}

    def at(self, r: int) -> np.ndarray:
        return np.full(self.numel, float(r), dtype="<f4")

    def sha256(self, r: int) -> str:
        if r not in self._sha:
            self._sha[r] = hashlib.sha256(self.at(r).tobytes()).hexdigest()
        return self._sha[r]

"""What a protocol agent sends that must pass for a real member's: its update, the
round's sample, its parameters' hash (`fedring.lab.loadgen`), all without torch.

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
    if value_dtype not in _WIRE:
        raise ValueError(f"value_dtype={value_dtype!r}: the load generator sends fp32 or fp16")
    n = -(-numel // group_size)
    idx = np.tile(np.arange(k, dtype=np.uint8 if group_size <= 256 else np.uint16), (n, 1))
    wire, dtype = _WIRE[value_dtype]
    meta = {"codec": "group-topk", "numel": numel, "group_size": group_size, "k": k,
            "groups": [0, n]}  # fmt: skip
    spec, body = pack_arrays([("idx", "u1" if group_size <= 256 else "u2", idx),
                              ("val", wire, np.zeros((n, k), dtype=dtype))])  # fmt: skip
    meta["arrays"] = spec
    return meta, body




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

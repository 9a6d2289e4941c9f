"""A model patch: the entries of a whole flat model that changed since a base version.

An asynchronous centre answers a member's delta with the current model
(`engine.centre.serve_async`). The member already holds the model the centre last
sent it (its base), so the centre may send only the entries whose bits changed
since then, with their exact float32 values (`engine.async_reply`). The index
forms are the checkpoint patch's (`wire.patch`: ``g1``, ``u2``, ``i4``; where most
entries moved the centre sends the dense model instead), and the patch names the
versions it joins and the sha256 of the model it makes, which the member checks.

Decoding checks everything against the payload itself (counts, increasing indices
below `numel`, finite values), so a patch from the network is refused with a
`PayloadError` before a member writes anything. Alone, a patch is only its values
at their places (`decompress`: zeros elsewhere); it means the model only on its
base.

    >>> import numpy as np, torch
    >>> p = ModelPatch.build(8, base=3, version=5, sha256="0" * 64, index="u2",
    ...                      at=np.array([1, 6], dtype="<u2"), values=torch.tensor([2.0, -1.0]))
    >>> p.decompress()
    tensor([ 0.,  2.,  0.,  0.,  0.,  0., -1.,  0.])
    >>> ModelPatch.from_wire(*_meta_arrays(p), PayloadLimits()).positions.tolist()
    [1, 6]
"""

from __future__ import annotations

import re
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
    finite,
    meta_int,
    no_extra,
)

GROUP = 256  # entries a group in the ``g1`` form (as `wire.patch`)
FORMS = ("g1", "u2", "i4")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_VERSION = (1 << 53) - 1


@dataclass(frozen=True, eq=False)
class ModelPatch:
    """Entries `positions` of a flat model of `numel` set to `values`: the model at
    `version` made from the one at `base`, whose sha256 is `sha256`."""

    codec_id: ClassVar[str] = "model-patch"
    numel: int
    base: int
    version: int
    sha256: str
    index: str  # g1 | u2 | i4, as `wire.patch`
    arrays: tuple[tuple[str, str, np.ndarray], ...]  # the index arrays as they travel
    positions: torch.Tensor  # [n] int64, increasing, < numel
    values: torch.Tensor  # [n] float32

    @classmethod
    def build(
        cls, numel: int, *, base: int, version: int, sha256: str, index: str,
        values: torch.Tensor, at: np.ndarray | None = None,
        counts: np.ndarray | None = None, where: np.ndarray | None = None,
    ) -> ModelPatch:  # fmt: skip
        """A patch from its index arrays (``at`` for u2/i4, ``counts`` and ``where``
        for g1), checked as a received one is."""
        named = {"counts": counts, "where": where} if index == "g1" else {"at": at}
        wire = {"u2": "u2", "i4": "i4"}.get(index, "u1")
        arrays = tuple((name, wire, a) for name, a in named.items() if a is not None)
        meta = {"codec": cls.codec_id, "numel": numel, "base": base, "version": version,
                "sha256": sha256, "index": index, "n": int(values.numel())}  # fmt: skip
        decoded = {name: (dtype, a) for name, dtype, a in arrays}
        decoded["val"] = ("f4", values.to(torch.float32).numpy())
        return cls.from_wire(meta, decoded, PayloadLimits(max_numel=max(numel, 1)))

    @property
    def wire_nbytes(self) -> int:
        return sum(a.nbytes for _, _, a in self.arrays) + 4 * self.values.numel()

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> None:
        out.index_add_(0, self.positions, self.values.to(out.dtype), alpha=alpha)

    def decompress(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        self.add_to(out)
        return out

    def apply(self, base: torch.Tensor) -> torch.Tensor:
        """The patched model: a copy of `base` (the flat float32 model at `self.base`)
        with this patch's entries written, bit for bit."""
        if base.numel() != self.numel or base.dtype != torch.float32:
            raise ValueError(f"a patch of {self.numel} entries on a base of {base.numel()}")
        out = base.clone()
        out[self.positions] = self.values
        return out

    def to_wire(self) -> tuple[dict[str, Any], WireArrays]:
        meta = {"codec": self.codec_id, "numel": self.numel, "base": self.base,
                "version": self.version, "sha256": self.sha256, "index": self.index,
                "n": int(self.values.numel())}  # fmt: skip
        return meta, [*self.arrays, ("val", "f4", self.values.numpy())]

    @classmethod
    def from_wire(
        cls, meta: Mapping[str, Any], arrays: Decoded, limits: PayloadLimits
    ) -> ModelPatch:
        numel = meta_int(meta, "numel", 1, limits.max_numel)
        version = meta_int(meta, "version", 0, _MAX_VERSION)
        base = meta_int(meta, "base", 0, version)
        n = meta_int(meta, "n", 0, numel)
        sha, index = meta.get("sha256"), meta.get("index")
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise PayloadError(PayloadReason.SHAPE_MISMATCH, f"meta 'sha256'={sha!r:.70}")
        if index not in FORMS:
            raise PayloadError(PayloadReason.BAD_DTYPE, f"meta 'index'={index!r:.20}: {FORMS}")
        _, val = array(arrays, "val", ("f4",), (n,))
        values = torch.from_numpy(np.array(val, dtype=np.float32))
        finite(values, "values")
        if index == "g1":
            groups = -(-numel // GROUP)
            _, counts = array(arrays, "counts", ("u1",), (groups,))
            _, where = array(arrays, "where", ("u1",), (n,))
            no_extra(arrays, {"counts", "where", "val"})
            total = int(counts.sum(dtype=np.int64))
            if total != n:
                raise PayloadError(PayloadReason.SHAPE_MISMATCH, f"g1 counts sum to {total}, n={n}")
            at = np.repeat(np.arange(groups, dtype=np.int64) * GROUP, counts) + where
            kept: tuple[tuple[str, str, np.ndarray], ...] = (
                ("counts", "u1", np.array(counts)), ("where", "u1", np.array(where)))  # fmt: skip
        else:
            wire = str(index)
            _, raw = array(arrays, "at", (wire,), (n,))
            no_extra(arrays, {"at", "val"})
            at = raw.astype(np.int64)
            kept = (("at", wire, np.array(raw)),)
        if n and (at[0] < 0 or at[-1] >= numel or bool(np.any(np.diff(at) <= 0))):
            raise PayloadError(PayloadReason.INDEX_OUT_OF_RANGE,
                               f"patch positions not increasing within [0, {numel})")  # fmt: skip
        return cls(numel, base, version, sha, str(index), kept, torch.from_numpy(at), values)


def _meta_arrays(p: ModelPatch) -> tuple[dict[str, Any], Decoded]:
    """`p` as a receiver's decoder sees it (for the doctest)."""
    meta, arrays = p.to_wire()
    return meta, {name: (dtype, a) for name, dtype, a in arrays}

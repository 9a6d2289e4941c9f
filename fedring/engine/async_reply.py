"""An asynchronous centre's replies: the member's last model patched where that is smaller.

`serve_async` (and `fedring simulate`'s async star) answers every delta with the
current model. A member already holds the model the centre last sent it, its
*base*, and between two of its pulls only the entries that some applied delta
touched have moved (a group-top-k delta moves about `density` of them), so the
centre sends a `ModelPatch`: the entries whose bits changed since the base, with
their exact float32 values, in the checkpoint patch's smallest index form
(`wire.patch`), and the sha256 of the model they make. Where that is not smaller
than the dense model (the member's first reply, a base so old that most entries
moved, dense deltas) the reply is the dense model, as before.

Memory: the centre keeps one int32 a parameter, the version at which each entry
last changed (`ChangeLog`), and one int a member, the version it holds, so the
entries changed since any base are ``last > base`` whatever the number of members
or how stale a base is: no snapshot per version or per member. A member keeps one
copy of the model (`AsyncBase`).

A member writes the patch into a copy of its base and checks the result's sha256;
a patch it cannot apply (no base, another size, a hash that disagrees) is counted
(``async_patch_refused``), logged, and answered by asking the centre again
(phase ``again``), which sends the dense model. A malformed patch never reaches
it: decoding refuses it (`ModelPatch.from_wire`) as any bad frame. The model a
member trains on is the dense reply's decoding of the same bits (``0 + x``: a -0.0
reads +0.0), so replies of either form give the same training, bit for bit.

    >>> import torch
    >>> replies = AsyncReplies(torch.zeros(1000), version=0)
    >>> type(replies.reply("a", torch.zeros(1000), 0)).__name__  # no base yet: dense
    'DenseChunk'
    >>> new = torch.zeros(1000); new[7] = 1.0
    >>> replies.applied(torch.zeros(1000), new, 1)
    >>> patch = replies.reply("a", new, 1)
    >>> type(patch).__name__, patch.wire_nbytes
    ('ModelPatch', 6)
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from fedring.compression.model_patch import ModelPatch
from fedring.compression.payload import Payload
from fedring.compression.quantize import DenseChunk, DenseCodec
from fedring.counters import Counters
from fedring.training.models import flat_sha256
from fedring.wire.patch import encode_changed

log = logging.getLogger(__name__)

# A patch's meta (versions, sha256, index form) is about this much longer than a
# dense reply's: a patch must save more than that to be sent.
META_SLACK = 160
_INT32_MAX = (1 << 31) - 1


class ChangeLog:
    """For every entry of a flat model, the last version at which its bits changed."""

    def __init__(self, numel: int, version: int) -> None:
        self.start = version  # bases older than this are unknown
        self.last: npt.NDArray[np.signedinteger[Any]] = np.full(
            numel, version, dtype=np.int32 if version < _INT32_MAX else np.int64
        )

    def record(self, old: torch.Tensor, new: torch.Tensor, version: int) -> None:
        """`new` (at `version`) replaced `old`: mark the entries whose bits differ."""
        if version > _INT32_MAX and self.last.dtype == np.int32:
            self.last = self.last.astype(np.int64)
        moved = old.numpy().view(np.uint32) != new.numpy().view(np.uint32)
        self.last[moved] = version

    def since(self, base: int) -> np.ndarray | None:
        """The increasing indices of the entries changed after version `base`; None
        where `base` is older than this log."""
        return None if base < self.start else np.flatnonzero(self.last > base)


class AsyncReplies:
    """The centre's side: what each member holds, and the reply that brings it up."""

    def __init__(
        self, model: torch.Tensor, version: int, *, patches: bool = True,
        counters: Counters | None = None,
    ) -> None:  # fmt: skip
        self.log = ChangeLog(model.numel(), version)
        self.patches = patches  # False: dense replies only, as before patches
        self.counters = counters or Counters()
        self.holds: dict[str, int] = {}  # member -> the version it was last sent
        self._sha: tuple[int, str] = (-1, "")

    def applied(self, old: torch.Tensor, new: torch.Tensor, version: int) -> None:
        """The centre moved from `old` to `new`, now at `version`."""
        self.log.record(old, new, version)

    def reply(self, member: str, model: torch.Tensor, version: int, *,
              dense: bool = False) -> Payload:  # fmt: skip
        """The reply bringing `member` to `model` (at `version`): a patch against what
        it holds where that is smaller, else (or with `dense`) the model whole."""
        whole = DenseCodec("fp32").compress(model)
        base = self.holds.get(member)
        self.holds[member] = version
        patch = None if dense or not self.patches or base is None else (
            self._patch(model, base, version))  # fmt: skip
        if patch is None or patch.wire_nbytes + META_SLACK >= whole.wire_nbytes:
            self.counters.add("async_reply_dense")
            return whole
        self.counters.add("async_reply_patch")
        return patch

    def _patch(self, model: torch.Tensor, base: int, version: int) -> ModelPatch | None:
        changed = self.log.since(base)
        if changed is None:
            return None
        doc, blob = encode_changed(model.numpy(), changed, lo=0)
        index, n = doc["index"], doc["n"]
        if index == "dense":
            return None
        values = torch.from_numpy(np.frombuffer(blob, dtype="<f4", count=n,
                                                offset=len(blob) - 4 * n).copy())  # fmt: skip
        if index == "g1":
            groups = len(blob) - 5 * n
            counts = np.frombuffer(blob, dtype=np.uint8, count=groups)
            where = np.frombuffer(blob, dtype=np.uint8, count=n, offset=groups)
            return ModelPatch.build(model.numel(), base=base, version=version,
                                    sha256=self._hash(model, version), index=index,
                                    values=values, counts=counts, where=where)  # fmt: skip
        at = np.frombuffer(blob, dtype="<u2" if index == "u2" else "<i4", count=n)
        return ModelPatch.build(model.numel(), base=base, version=version,
                                sha256=self._hash(model, version), index=index, values=values,
                                at=at)  # fmt: skip

    def _hash(self, model: torch.Tensor, version: int) -> str:
        if self._sha[0] != version:
            self._sha = (version, flat_sha256(model))
        return self._sha[1]


class AsyncBase:
    """A member's side: the model the centre last sent, bit for bit, to apply patches to."""

    def __init__(self, counters: Counters | None = None) -> None:
        self.model: torch.Tensor | None = None
        self.counters = counters or Counters()

    def take(self, reply: Payload) -> torch.Tensor | None:
        """The model to train on from the centre's reply; None where a patch cannot be
        applied (counted and logged: ask the centre for the whole model)."""
        if not isinstance(reply, ModelPatch):
            self.model = _exact(reply)
            return reply.decompress()
        why = self._refusal(reply)
        if why:
            self.counters.add("async_patch_refused")
            log.warning("refused the centre's patch %d -> %d: %s; asking for the whole model",
                        reply.base, reply.version, why)  # fmt: skip
            self.model = None
            return None
        return torch.zeros(reply.numel).add_(self.model)  # type: ignore[arg-type]

    def _refusal(self, patch: ModelPatch) -> str:
        """Why `patch` does not make the centre's model here ('' where it does; the
        patched model is then the base)."""
        if self.model is None:
            return "no base to patch"
        if self.model.numel() != patch.numel:
            return f"a patch of {patch.numel} entries for a model of {self.model.numel()}"
        new = patch.apply(self.model)
        sha = flat_sha256(new)
        if sha != patch.sha256:
            return f"the patched model hashes to {sha[:12]}..., not {patch.sha256[:12]}..."
        self.model = new
        return ""


def _exact(reply: Payload) -> torch.Tensor | None:
    """The bits of a whole float32 model in `reply` (a later patch's base), or None."""
    if isinstance(reply, DenseChunk) and reply.start == 0 and reply.values.dtype == torch.float32:
        return reply.values.clone() if reply.values.numel() == reply.numel else None
    return None

"""The ring's checkpoint stream, agent side: who sends the coordinator what, and when.

Every member of a synchronous ring holds the same parameters after every round, so
the coordinator need not be sent them whole each checkpoint. It keeps its own copy
(`coordinator.replica`), and at every checkpoint round each member *other than the
head* sends a patch of its slice of the flat parameters (1 / (N-1) of them): the
entries that changed since the last checkpoint, with the model's sha256. The head,
which already sends a metrics row every round, sends no patch: over the round the
bytes of the members even out. The head still uploads the dense model where the
coordinator has no copy to patch: the first checkpoint of a segment, when the
coordinator asks (its copy's hash disagreed), and wherever members' parameters
differ by design (`whole_only`). A ring of one patches itself.

    >>> s = CheckpointStream("a1", ["a0", "a1", "a2"], numel=10, dense=False)
    >>> s.span, s.head, s.patcher
    ((0, 5), False, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedring.aggregation.rules import Aggregation
from fedring.training.models import flat_sha256
from fedring.wire.patch import encode_patch


def whole_only(aggregation: str, mixed: bool) -> bool:
    """Whether the head uploads every checkpoint whole, as before patches: a ring of
    mixed architectures (its members' parameters differ between re-syncs) or the
    ``hybrid`` rule (each member mixes in its own update)."""
    return mixed or Aggregation.parse(aggregation).kind == "hybrid"


@dataclass
class CheckpointStream:
    me: str
    members: list[str]  # ring order; members[0] is the head
    numel: int
    dense: bool  # mixed architectures: the head's dense uploads only, as before patches
    base: np.ndarray | None = None  # my slice at `base_round`, what the coordinator holds
    base_round: int = -1

    @property
    def head(self) -> bool:
        return self.members[0] == self.me

    @property
    def patchers(self) -> list[str]:
        return self.members[1:] or self.members[:1]

    @property
    def patcher(self) -> bool:
        return not self.dense and self.me in self.patchers

    @property
    def span(self) -> tuple[int, int]:
        """This member's slice ``[lo, hi)`` of the flat parameters (equal parts)."""
        n, i = len(self.patchers), self.patchers.index(self.me)
        return self.numel * i // n, self.numel * (i + 1) // n

    def dense_due(self) -> bool:
        """Whether the head uploads the whole model at this checkpoint: always in a
        mixed ring, else only the segment's first (the coordinator patches from it)."""
        return self.head and (self.dense or self.base_round < 0)

    def checkpoint(
        self, r: int, params: torch.Tensor, epoch: int
    ) -> tuple[dict[str, Any], bytes] | None:
        """At checkpoint round `r` (the parameters at its start): the patch to send, or
        None where this member sends none now (it keeps its slice as the next base)."""
        if not self.patcher:
            self.base_round = r  # the head: later checkpoints are patched by the others
            return None
        lo, hi = self.span
        now = params[lo:hi].numpy().copy()
        base, since = self.base, self.base_round
        self.base, self.base_round = now, r
        if base is None:
            return None  # the segment's first: the head's dense upload is the base
        doc, blob = encode_patch(base, now, lo=lo)
        return {"round": r, "epoch": epoch, "from": since, "sha256": flat_sha256(params),
                **doc}, blob  # fmt: skip

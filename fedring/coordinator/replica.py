"""The coordinator's copy of a ring's model, kept up to date by the members' patches.

A synchronous ring's members hold the same parameters after every round. Rather
than the head uploading them whole at every checkpoint, each other member sends a
patch of its slice (`edge_agent.checkpoint_stream`, `wire.patch`): the entries that
changed since the last checkpoint, and the model's sha256. Once every patch of a
round is in, `Replica.take` writes them into a copy of the last checkpoint and
checks the result's sha256 against every member's claim: a match is the new
checkpoint, bit for bit what the members hold. Anything else (no base to patch,
a malformed patch, a hash that disagrees) asks the head for its whole model of that
round instead, which it holds while it waits for the checkpoint's ack; that upload
(`SegmentRunner._checkpoint`) becomes the base again.

    >>> import torch
    >>> r = Replica(); r.reset(torch.zeros(4), 3)
    >>> r.round
    3
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from fedring.training.models import flat_sha256
from fedring.wire.control import ControlMessage
from fedring.wire.errors import FrameError
from fedring.wire.patch import apply_patch

log = logging.getLogger(__name__)
MAX_PENDING = 4  # rounds of patches held while some are missing: older ones are dropped


@dataclass(frozen=True)
class Taken:
    """A round's patches, all in: the checkpoint (`params`), or why the head's whole
    model is needed instead (`params` None)."""

    round: int
    params: torch.Tensor | None
    why: str = ""


@dataclass
class Replica:
    params: torch.Tensor | None = None  # the model at `round` (None: nothing to patch)
    round: int = -1
    pending: dict[int, dict[str, ControlMessage]] = field(default_factory=dict)

    def reset(self, params: torch.Tensor, rnd: int) -> None:
        """A checkpoint the coordinator holds whole: later patches apply to it."""
        self.params, self.round = params, rnd
        self.pending = {r: got for r, got in self.pending.items() if r > rnd}

    def clear(self) -> None:
        """A new segment: its first checkpoint comes whole from the head."""
        self.params, self.round, self.pending = None, -1, {}

    def take(self, msg: ControlMessage, patchers: list[str]) -> Taken | None:
        """Hold `msg` (a patch of round ``msg.round`` from one of `patchers`); once all
        of that round's are in, the outcome; None while waiting (or for a stale or
        doubled patch, which is ignored)."""
        rnd = msg.round
        if msg.src not in patchers or rnd <= self.round:
            return None
        got = self.pending.setdefault(rnd, {})
        got[msg.src] = msg
        while len(self.pending) > MAX_PENDING:
            del self.pending[min(self.pending)]
        # the count first: the sets only once per round (N^2 a round were they built
        # at every patch, with a thousand members)
        if rnd not in self.pending or len(got) < len(patchers) or set(got) != set(patchers):
            return None
        del self.pending[rnd]
        return self._apply(rnd, list(got.values()))

    def _apply(self, rnd: int, patches: list[ControlMessage]) -> Taken:
        if self.params is None or any(p.doc.get("from") != self.round for p in patches):
            froms = sorted({str(p.doc.get("from")) for p in patches})
            return Taken(rnd, None, f"patches from round {froms}, the copy is of {self.round}")
        new = self.params.clone()
        flat = new.numpy()
        for p in patches:
            try:
                apply_patch(flat, p.doc, p.blob)
            except FrameError as exc:
                return Taken(rnd, None, f"patch from {p.src}: {exc}")
        sha = flat_sha256(new)
        wrong = sorted(p.src for p in patches if p.doc.get("sha256") != sha)
        if wrong:
            return Taken(rnd, None, f"patched copy hashes to {sha[:12]}..., not {wrong}'s")
        self.params, self.round = new, rnd
        return Taken(rnd, new)

"""The group's common start: rank 0's parameters and buffers, sent to every member.

DDP broadcasts rank 0's parameters and buffers when it is built; `DistributedOptimizer`
does the same (``initial="broadcast"``, the default), because nothing else makes
replicas start alike in a script of threads: ``torch.manual_seed(0)`` inside each
thread seeds the one global generator that all threads share, and two threads
that seed and then draw in turn build different models (agents that start apart
train on silently and never meet). The other policies:

- ``"verify"``: rank 0 sends only a sha256 of its parameters and buffers; a member
  whose own differ raises `InitialModelMismatch` naming both digests.
- ``"trust"``: no exchange; for callers that have already checked the start
  (`engine.plan.prepare` hash-checks it against the manifest; the runners do this).

Rank 0 pushes and returns at once; every other member waits (the group's
`timeout_s`) for rank 0's frames. So members may be built on threads or one after
another, rank 0 first. Bytes travel as 16-bit halves in float32 (each one exact and
finite, whatever the tensors' dtypes: integer buffers, NaN bits), twice the state's
size, sent by rank 0 to each member: (N - 1) x 2 x the model's bytes from rank 0,
once per group (``group.stats()`` counts them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from fedring.collective.channel import CollectiveTimeout, PeerChannel
from fedring.compression.payload import PayloadLimits
from fedring.compression.quantize import DenseChunk
from fedring.transport.base import Deadline

InitialPolicy = Literal["broadcast", "verify", "trust"]
INITIAL_POLICIES: tuple[InitialPolicy, ...] = ("broadcast", "verify", "trust")
PHASE = {"broadcast": "start", "verify": "start-sha256"}  # frame phase of round 0, step 0


class InitialModelMismatch(ValueError):
    """A member's initial parameters or buffers differ from rank 0's under
    ``initial="verify"``, or (any policy) its model's size differs from rank 0's."""


def start_together(
    channel: PeerChannel, members: Sequence[str], tensors: Sequence[torch.Tensor],
    policy: InitialPolicy, timeout_s: float,
) -> None:  # fmt: skip
    """Make `tensors` (parameters, then buffers) rank 0's on every member, or check them.

    Raises
    ------
    ValueError
        For an unknown `policy`.
    InitialModelMismatch
        With ``"verify"``, on a member whose tensors hash otherwise than rank 0's.
    CollectiveTimeout
        When rank 0's start does not come within `timeout_s`.
    """
    if policy not in INITIAL_POLICIES:
        raise ValueError(f"initial={policy!r} must be one of {', '.join(INITIAL_POLICIES)}")
    if policy == "trust" or len(members) == 1:
        return
    halves = _halves(tensors)
    mine = _digest(halves) if policy == "verify" else halves
    deadline = Deadline.after(timeout_s)
    if channel.name == members[0]:
        # One send per member, not `channel.broadcast`: a member's inbox is subscribed
        # before it is online (the ring relies on it), a job's broadcast topic maybe not.
        start = DenseChunk(mine.numel(), 0, mine)
        for dst in members[1:]:
            channel.send(dst, start, round=0, step=0, phase=PHASE[policy], deadline=deadline)
        return
    try:
        got = channel.recv(members[0], round=0, step=0, phase=PHASE[policy], deadline=deadline,
                           limits=PayloadLimits(max_numel=mine.numel())).decompress()  # fmt: skip
    except CollectiveTimeout as exc:
        raise CollectiveTimeout(
            f"{channel.name!r} waited {timeout_s:g} s for {members[0]!r}'s initial parameters: "
            "every member must build its DistributedOptimizer (with the same initial=)"
        ) from exc
    if got.numel() != mine.numel():
        raise InitialModelMismatch(
            f"{members[0]!r} sent {got.numel()} halves of initial state, {channel.name!r} "
            f"holds {mine.numel()}: the members built different models"
        )
    if policy == "verify":
        if not torch.equal(got, mine):
            raise InitialModelMismatch(
                f"{channel.name!r} starts from other parameters or buffers than "
                f"{members[0]!r} (sha256 {_hex(mine)[:12]}... vs {_hex(got)[:12]}...): "
                "build the model once before starting the threads, load one state_dict "
                "on every member, or pass initial='broadcast'"
            )
        return
    _load_halves(tensors, got)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _halves(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes back to back, as 16-bit halves in float32 (exact, finite)."""
    raw = np.concatenate([_as_bytes(t) for t in tensors]) if tensors else np.zeros(0, np.uint8)
    if raw.size % 2:
        raw = np.append(raw, np.uint8(0))
    return torch.from_numpy(raw.view("<u2").astype(np.float32))


def _load_halves(tensors: Sequence[torch.Tensor], halves: torch.Tensor) -> None:
    raw = halves.numpy().astype("<u2").view(np.uint8)
    pos = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel() * t.element_size()
            part = torch.from_numpy(raw[pos : pos + n].copy()).view(t.dtype).reshape(t.shape)
            t.copy_(part)
            pos += n


def _digest(halves: torch.Tensor) -> torch.Tensor:
    """sha256 of the halves as 32 float32 bytes (0..255: exact and finite)."""
    digest = hashlib.sha256(halves.numpy().astype("<u2").tobytes()).digest()
    return torch.tensor(list(digest), dtype=torch.float32)


def _hex(digest: torch.Tensor) -> str:
    return bytes(int(v) for v in digest.tolist()).hex()

"""One-step collectives over a broadcast: fan-out (sparse all-gather) and hub reduce.

A ring round is 2(N-1) sequential steps; over a broker each step is two hops, so
with a broker 20 ms away 4 agents pay 6 x 40 ms a round whatever the payload. A
broker fans out natively (one publish reaches every subscriber), and so these two
take one step:

- ``fanout``: every member broadcasts its compressed gradient once, receives the
  other N-1 and sums all N in rank order. Every member adds the same payloads in
  the same order, so every member gets the same bits; nothing is re-selected, so
  error feedback keeps only what the member's own compression dropped (`kept` is
  zero). Each member's downlink carries N-1 payloads: bytes grow with N, latency
  does not.
- ``hub``: members send their compressed gradient to the hub (the ring's head,
  rank 0), which sums them in rank order and broadcasts the sum once (as the exact
  union of supports, or dense when that is smaller). Two steps, and each member's
  downlink carries one (denser) payload; the hub's carries N-1.

Both are bit-identical across members and equal the dense sum of the members'
payloads, added in rank order. A member lost while one waits ends the wait with
`PeerLost`, a silent one with `CollectiveTimeout`, as in the ring, so the
coordinator re-forms the group. `flat` is the ring of the same members (the sign
vote runs on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fedring.collective.channel import PeerChannel
from fedring.collective.ring import Ring, SparsePolicy, _span, tagged
from fedring.compression.payload import Payload, PayloadLimits
from fedring.compression.quantize import DenseChunk, DenseCodec
from fedring.compression.sparse import GroupSparse, SparseGroups, n_groups
from fedring.compression.values import ValueDtype
from fedring.transport.base import Deadline
from fedring.wire.errors import FrameError, FrameReason

COLLECTIVES = ("ring", "fanout", "hub")


def _whole(p: Payload) -> tuple[int, int]:
    """The span a payload covering the whole vector has: all its groups, or all entries."""
    if isinstance(p, (SparseGroups, GroupSparse)):
        return 0, n_groups(p.numel, p.group_size)
    return 0, p.numel


def _check(expect: tuple[type, ...], numel: int, what: str) -> object:
    """An `accept` hook: a payload of one of `expect`, over the whole vector of `numel`."""

    def accept(p: Payload) -> None:
        if not isinstance(p, expect) or p.numel != numel or _span(p) != _whole(p):
            raise FrameError(
                FrameReason.UNEXPECTED,
                f"{what}: got {type(p).__name__} of {p.numel} over {_span(p)}, expected "
                f"{'/'.join(t.__name__ for t in expect)} of {numel} over the whole vector",
            )

    return accept


def _rank_sum(parts: dict[int, Payload], numel: int) -> torch.Tensor:
    """The payloads added in rank order into fp32 zeros: the same bits on every member."""
    out = torch.zeros(numel, dtype=torch.float32)
    for rank in sorted(parts):
        parts[rank].add_to(out)
    return out


@dataclass
class _OneStep:
    """What `Fanout` and `Hub` share: the members, this one's rank, the flat ring."""

    channel: PeerChannel
    members: tuple[str, ...]
    timeout_s: float = 30.0
    flat: Ring = field(init=False)  # the same members as a ring (the sign vote uses it)
    one_step: ClassVar[bool] = True  # a dense sum may travel at half width (`wire`)

    def __post_init__(self) -> None:
        self.flat = Ring(self.channel, self.members, self.timeout_s)
        self.rank, self.world = self.flat.rank, self.flat.world

    def allreduce_dense(
        self, x: torch.Tensor, *, round: int = 0, bucket: int | None = None,
        wire: ValueDtype = "fp32",
    ) -> torch.Tensor:  # fmt: skip
        """Sum of the members' flat float32 vectors, bit-identical on every member.

        `wire` ``fp16`` or ``bf16`` sends each member's vector at half the bytes (a
        dense plan under ``compression = "auto"``): every member adds the same rounded
        vectors in rank order into fp32, so the sum is still the same bits everywhere.
        (The ring cannot: its partial sums would be rounded again at every step.)"""
        flat = x.detach().reshape(-1).to(torch.float32)
        mine = (DenseChunk(flat.numel(), 0, flat.clone()) if wire == "fp32"
                else DenseCodec(wire).compress(flat))  # fmt: skip
        return self._combine(mine, (DenseChunk,), round=round, bucket=bucket)

    def allreduce_sparse(
        self, sparse: SparseGroups, *, policy: SparsePolicy = "bounded", round: int = 0,
        bucket: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Sum of the members' group-top-k payloads; ``(sum, kept)`` like `Ring`, with
        `kept` zero: nothing is re-selected on the way (`policy` has no say)."""
        out = self._combine(sparse, (SparseGroups,), round=round, bucket=bucket)
        return out, torch.zeros_like(out)

    def _combine(
        self, mine: Payload, expect: tuple[type, ...], *, round: int, bucket: int | None
    ) -> torch.Tensor:
        raise NotImplementedError  # Fanout: one broadcast each; Hub: up to rank 0 and back

    def _gather(
        self, srcs: list[int], payload_numel: int, expect: tuple[type, ...], *, round: int,
        phase: str, deadline: Deadline,
    ) -> dict[int, Payload]:  # fmt: skip
        got = self.channel.gather(
            [self.members[r] for r in srcs], round=round, step=0, phase=phase,
            deadline=deadline, accept=_check(expect, payload_numel, phase),  # type: ignore[arg-type]
            limits=PayloadLimits(max_numel=payload_numel),  # nothing bigger than ours is decoded
        )  # fmt: skip
        return {self.members.index(name): p for name, p in got.items()}


@dataclass
class Fanout(_OneStep):
    """One member's one-step all-gather over a broadcast (see the module docstring)."""

    def _combine(
        self, mine: Payload, expect: tuple[type, ...], *, round: int, bucket: int | None
    ) -> torch.Tensor:
        deadline = Deadline.after(self.timeout_s)
        phase = tagged("fan", bucket)
        self.channel.broadcast(mine, self.members, round=round, step=0, phase=phase,
                               deadline=deadline)  # fmt: skip
        others = [r for r in range(self.world) if r != self.rank]
        parts = self._gather(others, mine.numel, expect, round=round, phase=phase,
                             deadline=deadline)  # fmt: skip
        parts[self.rank] = mine
        return _rank_sum(parts, mine.numel)


@dataclass
class Hub(_OneStep):
    """One member's hub reduce: up to rank 0, the sum broadcast back (module docstring)."""

    @property
    def hub(self) -> str:
        return self.members[0]

    def _combine(
        self, mine: Payload, expect: tuple[type, ...], *, round: int, bucket: int | None
    ) -> torch.Tensor:
        deadline = Deadline.after(self.timeout_s)
        up, down = tagged("hub-up", bucket), tagged("hub-down", bucket)
        if self.rank != 0:
            self.channel.send(self.hub, mine, round=round, step=0, phase=up, deadline=deadline)
            got = self._gather([0], mine.numel, (GroupSparse, DenseChunk), round=round,
                               phase=down, deadline=deadline)  # fmt: skip
            return got[0].decompress()
        parts = self._gather(list(range(1, self.world)), mine.numel, expect, round=round,
                             phase=up, deadline=deadline)  # fmt: skip
        parts[0] = mine
        total = _packed(_rank_sum(parts, mine.numel), mine)
        self.channel.broadcast(total, self.members, round=round, step=0, phase=down,
                               deadline=deadline)  # fmt: skip
        return total.decompress()  # what the members decode, to the bit (a -0.0 included)


def _packed(total: torch.Tensor, like: Payload) -> Payload:
    """The sum as the smaller of its exact sparse form (a sparse input's group layout)
    and fp32 dense."""
    dense = DenseChunk(total.numel(), 0, total)
    if not isinstance(like, SparseGroups):
        return dense
    groups = (0, n_groups(like.numel, like.group_size))
    sparse = GroupSparse.from_dense(total, like.group_size, groups)
    return sparse if sparse.wire_nbytes < 4 * total.numel() else dense

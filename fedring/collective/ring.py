"""Ring all-reduce, dense and sparse (SEEDS part C, step 3).

N members form a ring in a fixed order. The vector is cut into N contiguous chunks
(aligned to group boundaries for sparse payloads, so every chunk carries the same
number of entries). Reduce-scatter: in step s (0..N-2) member r sends chunk
(r - s) mod N to its right neighbour and adds what arrives from its left into
chunk (r - s - 1) mod N; after N-1 steps member r holds chunk (r + 1) mod N fully
reduced. All-gather: N-1 more steps circulate the reduced chunks unchanged, so
every member ends with the same bits.

Sparse policies for group-top-k input:

- ``exact``: partial sums carry the union of supports (up to min(G, hops*k) per
  group); the result equals the dense sum of the sparse inputs.
- ``bounded``: before every send, and once more for the reduced chunk, the member
  re-selects the top-k of each group of its accumulated chunk and keeps the rest.
  Bytes per member stay 2(N-1)/N of one compressed gradient whatever N is.

Conservation invariant of ``bounded`` (nothing dropped is lost): every hop keeps
``accumulated - decompress(sent)`` computed exactly for fp32/fp16/bf16/int8 values
(see `values.exactify`; sign values to one rounding), so

    sum over members of the sparse inputs == result + sum over members of kept

up to the rounding of the ring's own additions, like any float all-reduce; where
those additions are exact (dyadic inputs, fp32/fp16 values, as in the tests) it
holds bit for bit. Callers add `kept` to their error-feedback residual.

A DGC-style sparse all-gather (every member's whole payload forwarded around the
ring, bytes growing with N) is here as the baseline the benchmarks compare with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, Literal

import torch

from fedring.collective.channel import PeerChannel
from fedring.compression.group_topk import GroupTopK
from fedring.compression.payload import Payload, PayloadLimits
from fedring.compression.quantize import DenseChunk
from fedring.compression.sparse import GroupSparse, SparseGroups, n_groups
from fedring.compression.values import ValueDtype
from fedring.transport.base import Deadline
from fedring.wire.errors import FrameError, FrameReason

SparsePolicy = Literal["exact", "bounded"]


def tagged(phase: str, bucket: int | None) -> str:
    """The frame phase of one bucket of a round (see `training.overlap`): buckets of
    the same round all-reduce one after another and must not take each other's frames."""
    return phase if bucket is None else f"{phase}.b{bucket}"


def chunk_bounds(units: int, world: int) -> list[tuple[int, int]]:
    """Split ``range(units)`` into `world` contiguous, nearly equal ranges."""
    return [(i * units // world, (i + 1) * units // world) for i in range(world)]


@lru_cache(maxsize=64)
def _topk(group_size: int, k: int, value_dtype: ValueDtype) -> GroupTopK:
    return GroupTopK(group_size, k, value_dtype)  # frozen: one per codec, not one per round


class SparseReduction:
    """One member's accumulator for a sparse all-reduce, shared by `Ring` and `Torus`.

    `chunk(span)` makes the payload this member sends for a span of groups:
    ``bounded`` re-selects the top-k per group and adds what it leaves to `kept`
    (exactly, so nothing is lost); ``exact`` sends the union of supports.
    """

    def __init__(self, sparse: SparseGroups, policy: SparsePolicy) -> None:
        if policy not in ("exact", "bounded"):
            raise ValueError(f"policy {policy!r} is not 'exact' or 'bounded'")
        self.policy = policy
        self.group_size = sparse.group_size
        self.acc = sparse.decompress()
        self.kept = torch.zeros_like(self.acc)
        self._acc_np, self._kept_np = self.acc.numpy(), self.kept.numpy()
        self.topk = _topk(sparse.group_size, sparse.k, sparse.value_dtype)
        self.expect: type = SparseGroups if policy == "bounded" else GroupSparse
        # Re-selecting groups that hold only this member's own payload keeps exactly
        # its entries (at most k non-zeros a group, values the wire dtype holds exactly)
        # and keeps nothing, so such a span is sent as the payload's rows: the same sums
        # and `kept` bit for bit (entries of 0 may sit elsewhere; adding 0 changes
        # nothing here, where no entry is -0). Only for what `GroupTopK` made (no
        # repeated indices) with fp32, fp16 or bf16 values (int8 would rescale).
        compressed = sparse.decoded is not None and sparse.wide_indices is not None
        whole = sparse.group_start == 0 and sparse.n == n_groups(sparse.numel, self.group_size)
        plain = whole and sparse.scales is None and not sparse.sign
        self._own = sparse if policy == "bounded" and compressed and plain else None
        self._touched: list[tuple[int, int]] = []  # spans sent or absorbed into

    def _fresh(self, span: tuple[int, int]) -> bool:
        fresh = not any(a < span[1] and span[0] < b for a, b in self._touched)
        self._touched.append(span)
        return fresh

    def chunk(self, span: tuple[int, int]) -> Payload:
        """The payload for groups ``span`` of the accumulator."""
        src = self.acc
        if self.policy == "exact":
            return GroupSparse.from_dense(src, self.group_size, span)
        if self._own is not None and self._fresh(span):
            return self._own.rows(*span)
        sent = self.topk.compress(src, groups=span)
        a, b = span[0] * self.group_size, min(span[1] * self.group_size, src.numel())
        self._kept_np[a:b] += self._acc_np[a:b]  # float32 in numpy: add_'s bits, a third the cost
        sent.add_to(self.kept, alpha=-1.0)  # exact: kept == accumulated - sent
        return sent

    def absorb(self, _: int, payload: Payload) -> None:
        if self._own is not None:
            self._touched.append(_span(payload))
        payload.add_to(self.acc)

    def repack(self, reduced: torch.Tensor, span: tuple[int, int], own: tuple[int, int]) -> Payload:
        """One payload for the already reduced groups `span` of `reduced`, which is
        rewritten to what the payload carries. Repacking wire-dtype values is exact;
        should it round, only groups `own` keep the difference here, so members that
        repack the same span each keep a disjoint part of it."""
        g = self.group_size
        if self.policy == "exact":
            return GroupSparse.from_dense(reduced, g, span)
        sent = self.topk.compress(reduced, groups=span)
        carried = torch.zeros_like(reduced)
        sent.add_to(carried)
        a, b = own[0] * g, min(own[1] * g, reduced.numel())
        self.kept[a:b].add_(reduced[a:b] - carried[a:b])
        lo, hi = span[0] * g, min(span[1] * g, reduced.numel())
        reduced[lo:hi] = carried[lo:hi]
        return sent


@dataclass
class Ring:
    """One member's view of a ring: its channel, the order, and a per-step timeout."""

    one_step: ClassVar[bool] = False  # dense sums in fp32 only (`allreduce_dense`)

    channel: PeerChannel
    members: tuple[str, ...]
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.channel.name not in self.members:
            raise ValueError(f"{self.channel.name!r} is not in the ring {self.members}")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"ring members repeat: {self.members}")
        self.rank = self.members.index(self.channel.name)
        self.world = len(self.members)
        self.right = self.members[(self.rank + 1) % self.world]
        self.left = self.members[(self.rank - 1) % self.world]

    @property
    def flat(self) -> Ring:
        """The ring itself (a `Torus` answers with its members as one flat ring)."""
        return self

    def exchange(
        self,
        payload: Payload,
        *,
        round: int,
        step: int,
        phase: str,
        expect: type,
        span: tuple[int, int],
    ) -> Payload:
        """Send `payload` right, return the left neighbour's payload for this step."""
        deadline = Deadline.after(self.timeout_s)
        self.channel.send(
            self.right, payload, round=round, step=step, phase=phase, deadline=deadline
        )

        def accept(p: Payload) -> None:
            got = _span(p)
            if not isinstance(p, expect) or got != span or p.numel != payload.numel:
                raise FrameError(
                    FrameReason.UNEXPECTED,
                    f"{phase} step {step}: got {type(p).__name__} {got}, "
                    f"expected {expect.__name__} {span}",
                )

        return self.channel.recv(
            self.left,
            round=round,
            step=step,
            phase=phase,
            deadline=deadline,
            accept=accept,
            limits=PayloadLimits(max_numel=payload.numel),  # nothing bigger than ours is decoded
        )

    def reduce_scatter(
        self,
        make: Callable[[int], Payload],
        absorb: Callable[[int, Payload], None],
        *,
        bounds: list[tuple[int, int]],
        expect: type,
        phase: str,
        round: int,
    ) -> int:
        """N-1 steps: send ``make(chunk)`` right, ``absorb(chunk, payload)`` from the left.

        Returns the chunk this member now holds fully reduced: (rank + 1) mod N.
        """
        for s in range(self.world - 1):
            send_c, recv_c = (self.rank - s) % self.world, (self.rank - s - 1) % self.world
            got = self.exchange(
                make(send_c), round=round, step=s, phase=phase, expect=expect, span=bounds[recv_c]
            )
            absorb(recv_c, got)
        return (self.rank + 1) % self.world

    def all_gather(
        self,
        mine: Payload,
        absorb: Callable[[int, Payload], None],
        *,
        bounds: list[tuple[int, int]],
        expect: type,
        phase: str,
        round: int,
    ) -> None:
        """N-1 steps circulating reduced chunks unchanged, starting with `mine`."""
        current = mine
        for s in range(self.world - 1):
            recv_c = (self.rank - s) % self.world
            current = self.exchange(
                current, round=round, step=s, phase=phase, expect=expect, span=bounds[recv_c]
            )
            absorb(recv_c, current)

    def allreduce_dense(
        self, x: torch.Tensor, *, round: int = 0, bucket: int | None = None,
        wire: ValueDtype = "fp32",
    ) -> torch.Tensor:  # fmt: skip
        """Sum of the members' flat float32 vectors (the uncompressed baseline).

        `bucket` tags the frames of one bucket of the round (see `tagged`).
        """
        if wire != "fp32":  # its partial sums would be rounded again at every step
            raise ValueError(f"a {type(self).__name__} sums dense vectors in fp32, not {wire}")
        acc = x.detach().reshape(-1).to(torch.float32).clone()
        bounds = chunk_bounds(acc.numel(), self.world)

        def chunk(c: int) -> DenseChunk:
            a, b = bounds[c]
            return DenseChunk(acc.numel(), a, acc[a:b].clone())

        def replace(c: int, p: Payload) -> None:
            a, b = bounds[c]
            acc[a:b].copy_(p.values)  # type: ignore[attr-defined]

        mine = self.reduce_scatter(
            chunk,
            lambda _, p: p.add_to(acc),
            bounds=bounds,
            expect=DenseChunk,
            phase=tagged("rs", bucket),
            round=round,
        )
        self.all_gather(
            chunk(mine), replace, bounds=bounds, expect=DenseChunk,
            phase=tagged("ag", bucket), round=round,
        )  # fmt: skip
        return acc

    def allreduce_sparse(
        self, sparse: SparseGroups, *, policy: SparsePolicy = "bounded", round: int = 0,
        bucket: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Sum of the members' group-top-k payloads; returns ``(sum, kept)``.

        `kept` is zero for ``exact``; for ``bounded`` it is what this member's
        re-selections dropped, to be added to its error-feedback residual.
        `bucket` tags the frames of one bucket of the round (see `tagged`).
        """
        red = SparseReduction(sparse, policy)
        bounds = chunk_bounds(n_groups(sparse.numel, sparse.group_size), self.world)
        mine = self.reduce_scatter(
            lambda c: red.chunk(bounds[c]),
            red.absorb,
            bounds=bounds,
            expect=red.expect,
            phase=tagged("rs", bucket),
            round=round,
        )
        out = torch.zeros_like(red.acc)
        reduced = red.chunk(bounds[mine])
        reduced.add_to(out)
        self.all_gather(
            reduced,
            lambda _, p: p.add_to(out),
            bounds=bounds,
            expect=red.expect,
            phase=tagged("ag", bucket),
            round=round,
        )
        return out, red.kept

    def allgather_sparse(self, sparse: SparseGroups, *, round: int = 0) -> torch.Tensor:
        """Baseline: forward every member's whole payload around the ring and sum."""
        whole = (0, n_groups(sparse.numel, sparse.group_size))
        received: dict[int, Payload] = {self.rank: sparse}
        current: Payload = sparse
        for s in range(self.world - 1):
            current = self.exchange(
                current, round=round, step=s, phase="gather", expect=SparseGroups, span=whole
            )
            received[(self.rank - s - 1) % self.world] = current
        out = torch.zeros(sparse.numel, dtype=torch.float32)
        for origin in range(self.world):  # same order everywhere: same bits everywhere
            received[origin].add_to(out)
        return out


def _span(p: Payload) -> tuple[int, int]:
    if isinstance(p, DenseChunk):
        return p.start, p.start + p.values.numel()
    if isinstance(p, (SparseGroups, GroupSparse)):
        return p.group_start, p.group_start + p.n
    start, length = getattr(p, "start", -1), getattr(p, "length", 0)
    return start, start + length

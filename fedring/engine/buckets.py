"""Buckets: the flat gradient cut into ranges that can be sent before backward ends.

Backward computes the gradients of the last layers first. `bucket_layout` walks
the parameters from the last to the first and closes a bucket once it holds about
`bucket_numel` entries, so bucket 0 is the end of the flat vector and is ready
first. Cuts sit at parameter boundaries, rounded up to a whole group of
`group_size` entries: group-top-k then selects per bucket exactly what it selects
over the whole vector, and the few entries of a parameter left below a cut go to
the next bucket, which is ready later anyway. The first parameters join the
bucket after them when they would fill less than half a bucket: every bucket
costs the latency of a whole ring, 2(N-1) steps.

`Readiness` follows one backward pass: told which parameter's gradient is in, it
answers with the buckets that may go now, always in bucket order, so every agent
hands its buckets to the ring in the same sequence.

    >>> [(b.start, b.end) for b in bucket_layout([300, 20, 600, 10], 500, 256)]
    [(512, 930), (0, 512)]
    >>> [(b.start, b.end) for b in bucket_layout([100, 20, 600, 10], 500, 64)]
    [(0, 730)]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    """Entries ``[start, end)`` of the flat vector and the parameters they come from."""

    start: int
    end: int
    params: tuple[int, ...]  # indices in `model.parameters()` order

    @property
    def numel(self) -> int:
        return self.end - self.start


def bucket_layout(sizes: Sequence[int], bucket_numel: int, group_size: int) -> list[Bucket]:
    """Buckets over parameters of `sizes` (in `model.parameters()` order), in backward order.

    Together they cover ``[0, sum(sizes))`` once; every bucket but the one at the
    end of the vector starts and ends on a multiple of `group_size`.
    """
    if bucket_numel < 1 or group_size < 1:
        raise ValueError(f"bucket_numel={bucket_numel} and group_size={group_size} must be >= 1")
    offsets = list(itertools.accumulate(sizes, initial=0))
    cuts = [offsets[-1]]  # descending: each closes the bucket above it
    filled = 0
    for i in reversed(range(len(sizes))):
        filled += sizes[i]
        if filled < bucket_numel:
            continue
        cut = -(-offsets[i] // group_size) * group_size
        if 0 < cut < cuts[-1]:
            cuts.append(cut)
            filled = cut - offsets[i]
    if len(cuts) > 1 and 2 * cuts[-1] < bucket_numel:
        cuts.pop()  # a remainder under half a bucket is not worth a ring of its own
    if cuts[-1] > 0:
        cuts.append(0)
    return [
        Bucket(start, end, _params_in(offsets, start, end))
        for end, start in itertools.pairwise(cuts)
    ]


def _params_in(offsets: list[int], start: int, end: int) -> tuple[int, ...]:
    """Parameters with at least one entry in ``[start, end)``."""
    return tuple(i for i in range(len(offsets) - 1) if offsets[i] < end and offsets[i + 1] > start)


class Readiness:
    """Which buckets may go, as the gradients of one backward pass come in."""

    def __init__(self, buckets: Sequence[Bucket]) -> None:
        self._missing = [set(b.params) for b in buckets]
        self._next = 0  # buckets before this one were handed over

    def arrived(self, param: int) -> list[int]:
        """Note `param`'s gradient; the buckets that are now complete, in order."""
        for missing in self._missing[self._next :]:
            missing.discard(param)
        return self._take(lambda j: not self._missing[j])

    def rest(self) -> list[int]:
        """After backward: every bucket not yet handed over (a parameter without a
        gradient this step never reports; its entries are zero)."""
        return self._take(lambda j: True)

    def _take(self, ready: Callable[[int], bool]) -> list[int]:
        out = []
        while self._next < len(self._missing) and ready(self._next):
            out.append(self._next)
            self._next += 1
        return out

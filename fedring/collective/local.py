"""Run a ring of N members on threads over the in-process transport.

Used by `fedring bench ring`, the tests and (later) `fedring simulate`: real
frames, real decoding, one thread per member.

    >>> import torch
    >>> outs = run_local_ring(3, lambda ring: ring.allreduce_dense(torch.ones(5)))
    >>> [o.tolist() for o in outs.results][0]
    [3.0, 3.0, 3.0, 3.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.collective.ring import Ring
from fedring.collective.torus import Torus
from fedring.counters import Counters
from fedring.transport.base import LinkStats
from fedring.transport.inproc import InprocTransport
from fedring.wire.frame import FrameLimits

T = TypeVar("T")


@dataclass
class LocalRun(Generic[T]):
    results: list[T]
    stats: list[LinkStats]  # per member, in ring order
    payload_bytes: list[int]  # bodies only, per member
    counters: Counters


def run_local_ring(
    world: int,
    fn: Callable[[Any], T],
    *,
    job: str = "local",
    key: bytes | None = None,
    limits: FrameLimits | None = None,
    timeout_s: float = 60.0,
    transport: InprocTransport | None = None,
    grid_rows: int = 0,
    grid_dims: tuple[int, ...] = (),
) -> LocalRun[T]:
    """Call ``fn(ring)`` for every member concurrently; re-raise the first failure.

    With `grid_rows` R > 0, each member gets an R x N/R `Torus` instead of a `Ring`;
    with `grid_dims`, a `Torus` of those axes (outermost first).
    """
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    hub = transport or InprocTransport()
    names = tuple(f"agent-{i}" for i in range(world))
    counters = Counters()
    channels = [
        PeerChannel(hub.connect(n), job, key=key, limits=limits, counters=counters) for n in names
    ]
    gridded = bool(grid_rows or grid_dims)
    rings: list[Ring | Torus] = [
        Torus(ch, names, timeout_s, rows=grid_rows, dims=grid_dims)
        if gridded
        else Ring(ch, names, timeout_s)
        for ch in channels
    ]

    def member(ring: Ring | Torus) -> T:
        try:
            return fn(ring)
        except BaseException:
            ring.channel.endpoint.close()  # neighbours see 'left' and fail fast too
            raise

    try:
        with ThreadPoolExecutor(max_workers=world, thread_name_prefix="ring") as pool:
            futures = [pool.submit(member, ring) for ring in rings]
            errors = [f.exception() for f in futures]
            # The root cause is the failure that is not a neighbour's reaction to it.
            causes = [e for e in errors if e is not None and not isinstance(e, CollectiveError)]
            first = causes or [e for e in errors if e is not None]
            if first:
                raise first[0]
            results = [f.result() for f in futures]
    finally:
        for ch in channels:
            ch.endpoint.close()
    return LocalRun(
        results=results,
        stats=[ch.endpoint.stats for ch in channels],
        payload_bytes=[ch.payload_bytes_sent for ch in channels],
        counters=counters,
    )

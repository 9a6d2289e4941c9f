"""Run one function per member of a `local_group` on threads, as a user's script does."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import fedring

T = TypeVar("T")


def on_threads(
    n: int, agent: Callable[[int, fedring.Group], T], *, timeout_s: float = 10.0
) -> list[T]:
    """`agent(rank, group)` on `n` threads; a failing member closes its endpoint so
    that its neighbours stop at once; the first failure is re-raised."""
    groups = fedring.local_group(n, timeout_s=timeout_s)

    def run(rank: int) -> T:
        try:
            return agent(rank, groups[rank])
        except BaseException:
            groups[rank].channel.endpoint.close()
            raise

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(run, r) for r in range(n)]
        return [f.result() for f in futures]

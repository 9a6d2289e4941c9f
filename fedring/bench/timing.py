"""Best-of-N wall-clock timing, the least noisy figure on a shared machine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def best_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Minimum wall time of `fn` over `repeats` runs, in milliseconds."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3

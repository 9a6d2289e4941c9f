"""What this CPU's codec costs: group-top-k compress and decode-and-add, timed.

An agent measures it once at start-up and announces it in its hello; the
coordinator's cost model (`collective.cost`) turns it into the codec part of each
collective's round. Each operation is timed on a small and a large vector (best of
a few repeats) and fitted as ``fixed + per_entry * n``: the fixed part is the
per-call Python work that dominates small models, the slope the vectorised work.

    >>> enc, dec = codec_cost(sizes=(1024, 16384), repeats=1)
    >>> all(v >= 0 for v in enc + dec)
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from fedring.compression.group_topk import GroupTopK

PROBE_SIZES = (4096, 262144)  # entries: a small model's chunk, a 1 MB gradient


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _fit(sizes: tuple[int, int], seconds: tuple[float, float]) -> tuple[float, float]:
    """``(fixed, per_entry)`` through the two measurements, both kept >= 0."""
    (n0, n1), (t0, t1) = sizes, seconds
    slope = max((t1 - t0) / (n1 - n0), 0.0)
    return max(t0 - slope * n0, 0.0), slope


def codec_cost(
    sizes: tuple[int, int] = PROBE_SIZES, repeats: int = 3, density: float = 0.01,
    group_size: int = 256,
) -> tuple[tuple[float, float], tuple[float, float]]:  # fmt: skip
    """``(encode, decode)``, each ``(fixed seconds, seconds per entry)``, of
    group-top-k at `density` with fp16 values (the default job's codec)."""
    codec = GroupTopK.from_density(density, group_size, "fp16")
    gen = torch.Generator().manual_seed(0)
    enc, dec = [], []
    for n in sizes:
        x = torch.randn(n, generator=gen)
        payload = codec.compress(x)
        out = torch.zeros(n)
        enc.append(_best(partial(codec.compress, x), repeats))
        dec.append(_best(partial(payload.add_to, out), repeats))
    return _fit(sizes, (enc[0], enc[1])), _fit(sizes, (dec[0], dec[1]))

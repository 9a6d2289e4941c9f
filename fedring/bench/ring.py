"""`fedring bench ring`: bytes per agent of four all-reduce schemes, real frames.

Every scheme runs N agents on threads over the in-process transport; bytes are
the encoded frames each agent sent (compact headers, tags, parts included), as
the transport counted them. Schemes:
- dense: fp32 ring all-reduce, the baseline (ratio 1);
- exact: sparse ring, partial sums carry the union of supports;
- bounded: sparse ring, top-k re-selected at every hop (fedring's default);
- allgather_dgc: every agent's payload forwarded to all (DGC-style sparse all-gather).
`ratio_vs_dense` = dense bytes per agent / the scheme's bytes per agent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fedring.collective.local import run_local_ring
from fedring.collective.ring import Ring, SparsePolicy
from fedring.compression.group_topk import GroupTopK
from fedring.compression.values import ValueDtype

_KEY = b"bench-job-key"


def _measure(world: int, fn: Callable[[Ring], Any]) -> tuple[dict[str, Any], list[Any]]:
    start = time.perf_counter()
    run = run_local_ring(world, fn, key=_KEY)
    wall = time.perf_counter() - start
    sent = [s.bytes_sent for s in run.stats]
    return {
        "bytes_per_agent": sum(sent) / world,
        "max_bytes_per_agent": max(sent),
        "frames_per_agent": sum(s.frames_sent for s in run.stats) / world,
        "wall_ms": wall * 1e3,
        "refused_frames": sum(
            v for k, v in run.counters.snapshot().items() if k.startswith("frame_")
        ),
    }, run.results


def run_one(world: int, numel: int, compressor: GroupTopK, seed: int) -> dict[str, Any]:
    xs = [
        torch.randn(numel, generator=torch.Generator().manual_seed(seed + i)) for i in range(world)
    ]
    sparse = [compressor.compress(x) for x in xs]
    dense_ref = torch.stack([x.double() for x in xs]).sum(0)
    sparse_ref = torch.stack([s.decompress().double() for s in sparse]).sum(0)
    row: dict[str, Any] = {"agents": world}
    row["dense"], outs = _measure(world, lambda r: r.allreduce_dense(xs[r.rank]))
    row["dense"]["max_abs_err"] = float((outs[0].double() - dense_ref).abs().max())
    policies: tuple[SparsePolicy, ...] = ("exact", "bounded")
    for policy in policies:

        def reduce(r: Ring, p: SparsePolicy = policy) -> Any:
            return r.allreduce_sparse(sparse[r.rank], policy=p)

        row[policy], outs = _measure(world, reduce)
        total, kept = outs[0][0].double(), sum(o[1].double() for o in outs)
        # exact: distance to the sum; bounded: conservation (result + kept == sum).
        row[policy]["max_abs_err"] = float((total + kept - sparse_ref).abs().max())
    row["allgather_dgc"], outs = _measure(world, lambda r: r.allgather_sparse(sparse[r.rank]))
    row["allgather_dgc"]["max_abs_err"] = float((outs[0].double() - sparse_ref).abs().max())
    dense_bytes = row["dense"]["bytes_per_agent"]
    for scheme in ("dense", "exact", "bounded", "allgather_dgc"):
        b = row[scheme]["bytes_per_agent"]
        row[scheme]["ratio_vs_dense"] = dense_bytes / b if b else float("inf")
    return row


def run(
    agents: int = 8,
    sweep: Iterable[int] = (2, 4, 8, 16),
    numel: int = 1_000_000,
    density: float = 0.01,
    group_size: int = 256,
    value_dtype: ValueDtype = "fp16",
    seed: int = 0,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    compressor = GroupTopK.from_density(density, group_size, value_dtype)
    worlds = sorted({agents, *sweep})
    rows = []
    for world in worlds:
        rows.append(run_one(world, numel, compressor, seed))
        if on_row is not None:
            on_row(rows[-1])
    return {
        "numel": numel,
        "density": density,
        "group_size": group_size,
        "k": compressor.k,
        "value_dtype": value_dtype,
        "agents": agents,
        "results": rows,
        "bounded_ratio_vs_dense": {str(r["agents"]): r["bounded"]["ratio_vs_dense"] for r in rows},
    }

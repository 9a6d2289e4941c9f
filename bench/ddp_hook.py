"""DDP over gloo three ways: plain all-reduce, torch's PowerSGD hook, fedring's group-top-k hook.

One run trains the same task once per method on `--world` local processes
(`fedring.bench.ddp_hook_bench`): fedring's iid digits shards and seeded MLP
(17,226 parameters), `--steps` steps of `--batch` samples a rank, the same SGD
for every method (default: lr 0.5, no momentum), the same seed. PowerSGD and
group-top-k both run `--start-iter` dense all-reduce steps first.

Columns: final test accuracy (after the last step; all ranks hold the same
model); bytes one rank sent over the whole run by the ring convention (an
all-reduce of B bytes sends ``2 (N-1)/N x B``, an all-gather of a P-byte payload
``(N-1) x P``): fp32 gradients for DDP, PowerSGD's three all-reduces
(uncompressed tensors, P, Q) from its own element counts, and for group-top-k
the values and indices it actually packed; "vs DDP" is DDP's bytes divided by
the method's; wall seconds of rank 0's training loop, with all ranks sharing
this machine's cores.

    python bench/ddp_hook.py [--world 4] [--steps 300] [--batch 32] [--lr 0.5]
                             [--momentum 0] [--start-iter 10] [--density 0.01] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fedring.bench.ddp_hook_bench import RunConfig, run_world
from fedring.compression.group_topk import GroupTopK
from fedring.compression.sparse import n_groups


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks on this host")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32, help="samples a rank a step")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--start-iter", type=int, default=10, help="dense steps before compressing")
    p.add_argument("--density", type=float, default=0.01, help="group-top-k, groups of 256")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def _methods(base: RunConfig) -> list[tuple[str, RunConfig]]:
    k = GroupTopK.from_density(base.density).k
    return [
        ("DDP all-reduce (fp32)", replace(base, method="ddp")),
        ("DDP + PowerSGD rank 1", replace(base, method="powersgd", powersgd_rank=1)),
        ("DDP + PowerSGD rank 2", replace(base, method="powersgd", powersgd_rank=2)),
        (f"DDP + group-top-k {k}/256 + EF (ours)", replace(base, method="group-topk")),
    ]


def _row(label: str, cfg: RunConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_world(cfg, Path(tmp), timeout_s=300.0)
    same = all(bool((r["params"] == ranks[0]["params"]).all()) for r in ranks)
    return {"method": label, "config": asdict(cfg), "accuracy": ranks[0]["accuracy"],
            "sent_bytes": max(r["sent_bytes"] for r in ranks), "wall_s": ranks[0]["wall_s"],
            "params": ranks[0]["params"].numel(), "ranks_identical": same}  # fmt: skip


def _table(rows: list[dict[str, Any]], base: RunConfig) -> str:
    dense = rows[0]["sent_bytes"]
    lines = ["| method | test acc | sent / rank (MB) | vs DDP | wall s |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        ratio = dense / r["sent_bytes"] if r["sent_bytes"] else float("inf")
        lines.append(f"| {r['method']} | {r['accuracy']:.4f} | {r['sent_bytes'] / 1e6:.3f} "
                     f"| {ratio:.1f}x | {r['wall_s']:.1f} |")  # fmt: skip
    topk = GroupTopK.from_density(base.density)
    payload = n_groups(rows[0]["params"], topk.group_size) * topk.k * 5
    n = base.world
    lines += [
        "",
        f"{n} gloo ranks on one host, digits MLP ({rows[0]['params']} parameters), "
        f"{base.steps} steps x {base.batch_size} samples a rank, SGD lr {base.lr} momentum "
        f"{base.momentum}, seed {base.seed}; PowerSGD and group-top-k start after "
        f"{base.start_compress_iter} dense steps.",
        f"Bytes sent per rank, ring convention: all-reduce 2(N-1)/N x B, all-gather "
        f"(N-1) x payload, N = {n}. Ours: {topk.k} of every {topk.group_size} entries "
        f"(fp32 value + uint8 index), {payload} B payload a compressed step.",
        "Ranks identical after training: "
        + ", ".join(f"{r['method'].split(' (')[0]}: {r['ranks_identical']}" for r in rows),
    ]
    return "\n".join(lines)


def main() -> None:
    a = _parser().parse_args()
    base = RunConfig(world=a.world, steps=a.steps, batch_size=a.batch, lr=a.lr,
                     momentum=a.momentum, seed=a.seed, density=a.density,
                     start_compress_iter=a.start_iter)  # fmt: skip
    rows = [_row(label, cfg) for label, cfg in _methods(base)]
    print(json.dumps(rows, indent=1) if a.json else _table(rows, base))


if __name__ == "__main__":
    main()

"""Digits, MLP, 4 agents, iid: dense ring vs group-top-k with and without error feedback.

The first acceptance item of the training issue, measured in one run:
- dense fp32 ring (the baseline): momentum SGD, m = 0.9, base lr 0.025;
- group-top-k 1% + error feedback, bounded ring (fedring's default: plain EF-SGD,
  no momentum, base lr 0.1);
- group-top-k 1% without error feedback (the negative control);
- group-top-k 0.1% + error feedback at G = 1024 (k = 1 per group: 0.098%);
- group-top-k 1% + EF with DGC momentum correction (m = 0.9, lr 0.025), the
  former default, for comparison.
Accuracy is the mean (and min-max) of 3 seeds; bytes are per agent, frames included.

    python bench/train_digits.py [--seeds 0,1,2] [--rounds 600] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fedring.config import JobSpec
from fedring.sim.runner import simulate

RUNS = {
    "dense ring": {"compression": "none"},
    "group-topk 1% + EF": {"density": 0.01},
    "group-topk 1%, no EF": {"density": 0.01, "error_feedback": False},
    "group-topk 0.1% + EF": {"density": 0.001, "group_size": 1024},
    "1% + EF, DGC momentum": {"density": 0.01, "momentum_correction": True, "lr": 0.025},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--lr", type=float, default=0.0, help="base LR for every run; 0 = auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    table = {}
    for name, changes in RUNS.items():
        accs, sent = [], []
        start = time.perf_counter()
        for seed in seeds:
            spec = JobSpec(
                **{
                    "agents": 4,
                    "dataset": "digits",
                    "rounds": args.rounds,
                    "seed": seed,
                    **({"lr": args.lr} if args.lr else {}),
                    **changes,
                }
            )
            s = simulate(spec)
            accs.append(s["final_accuracy"])
            sent.append(s["bytes_sent_per_agent"])
        table[name] = {
            "accuracy_mean": statistics.mean(accs),
            "accuracy_min": min(accs),
            "accuracy_max": max(accs),
            "bytes_per_agent": statistics.mean(sent),
            "seconds": time.perf_counter() - start,
        }
    dense = table["dense ring"]
    for row in table.values():
        row["pp_vs_dense"] = 100 * (row["accuracy_mean"] - dense["accuracy_mean"])
        row["bytes_ratio_vs_dense"] = dense["bytes_per_agent"] / row["bytes_per_agent"]
    if args.json:
        out = {"seeds": seeds, "rounds": args.rounds, "lr": args.lr, "results": table}
        print(json.dumps(out, sort_keys=True))
        return
    print(
        f"digits, MLP, 4 agents iid, {args.rounds} rounds, "
        f"base lr {args.lr or 'auto'}, seeds {seeds}"
    )
    head = ("", "accuracy mean [min, max]", "pp vs dense", "bytes/agent", "x fewer")
    print(f"{head[0]:24} {head[1]:>28} {head[2]:>12} {head[3]:>13} {head[4]:>8}")
    for name, r in table.items():
        acc = f"{r['accuracy_mean']:.4f} [{r['accuracy_min']:.4f}, {r['accuracy_max']:.4f}]"
        print(f"{name:24} {acc:>28} {r['pp_vs_dense']:>+12.2f} {r['bytes_per_agent']:>13,.0f} "
              f"{r['bytes_ratio_vs_dense']:>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""mnist1d, the MNIST-1D paper's CNN, 8 agents, dirichlet:0.5: dense ring vs group-top-k 1%.

The second acceptance item of the training issue, measured in one run, both
sides at fedring's defaults for the same number of rounds:
- dense fp32 ring: momentum SGD (m = 0.9), base lr 0.025;
- group-top-k 1% + error feedback, bounded ring: plain EF-SGD (no momentum),
  base lr 0.1. DGC momentum correction (`momentum_correction`) is unstable
  here: with 8 non-iid agents at 1% the momentum-amplified residual arrives in
  late bursts and accuracy falls back towards chance (0.46 after 600 rounds).
Accuracy is the mean (and min-max) of 3 seeds, printed beside the single-machine
CNN accuracy the MNIST-1D paper reports (Greydanus 2020: about 94%).

    python bench/train_mnist1d.py [--seeds 0,1,2] [--rounds 1500] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fedring.config import JobSpec
from fedring.sim.runner import simulate

PAPER_CNN_ACCURACY = 0.94  # MNIST-1D paper, ConvBase, single machine
RUNS = {
    "dense ring (m 0.9, lr 0.025)": {"compression": "none"},
    "group-topk 1% + EF (EF-SGD, lr 0.1)": {"density": 0.01},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    table = {}
    for name, changes in RUNS.items():
        accs, sent = [], []
        start = time.perf_counter()
        for seed in seeds:
            spec = JobSpec(
                agents=8, dataset="mnist1d", model="cnn", sharding="dirichlet:0.5",
                rounds=args.rounds, eval_every=50, seed=seed, **changes,  # type: ignore[arg-type]
            )  # fmt: skip
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
    dense = next(iter(table.values()))
    for row in table.values():
        row["pp_vs_dense"] = 100 * (row["accuracy_mean"] - dense["accuracy_mean"])
        row["bytes_ratio_vs_dense"] = dense["bytes_per_agent"] / row["bytes_per_agent"]
    if args.json:
        out = {"seeds": seeds, "rounds": args.rounds, "paper_cnn_accuracy": PAPER_CNN_ACCURACY,
               "results": table}  # fmt: skip
        print(json.dumps(out, sort_keys=True))
        return
    print(f"mnist1d, CNN, 8 agents dirichlet:0.5, {args.rounds} rounds, seeds {seeds}")
    head = ("", "accuracy mean [min, max]", "pp vs dense", "bytes/agent", "x fewer")
    print(f"{head[0]:34} {head[1]:>28} {head[2]:>12} {head[3]:>13} {head[4]:>8}")
    for name, r in table.items():
        acc = f"{r['accuracy_mean']:.4f} [{r['accuracy_min']:.4f}, {r['accuracy_max']:.4f}]"
        print(f"{name:34} {acc:>28} {r['pp_vs_dense']:>+12.2f} {r['bytes_per_agent']:>13,.0f} "
              f"{r['bytes_ratio_vs_dense']:>8.1f}")  # fmt: skip
    print(f"{'MNIST-1D paper, CNN, one machine':34} {PAPER_CNN_ACCURACY:>28.2f}")


if __name__ == "__main__":
    main()

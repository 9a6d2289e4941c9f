"""Linear LR scaling with gradual warm-up at N = 8 (Goyal et al. 2017), as loss curves.

Digits, MLP, 8 agents iid, dense ring, momentum 0.9, base lr 0.025 for one agent
at batch 32, mean of 3 seeds, all in one run:
- `linear` + warm-up: lr = 0.025 * 8 = 0.2, reached over the first 50 steps;
- `linear`, no warm-up: 0.2 from the first step;
- `none`: 0.025, what one agent would use, with 8x the batch.
The table prints the training loss (mean over agents and seeds, over the 10 rounds
ending at each mark) and the final test accuracy; `--json` gives every curve.

    python bench/lr_scaling.py [--seeds 0,1,2] [--rounds 300] [--compression none] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from fedring.config import JobSpec
from fedring.sim.runner import simulate

RUNS = {
    "linear + warm-up 50": {"lr_scaling": "linear", "warmup_steps": 50},
    "linear, no warm-up": {"lr_scaling": "linear", "warmup_steps": 0},
    "none (lr of one agent)": {"lr_scaling": "none", "warmup_steps": 0},
}
MARKS = (10, 25, 50, 100, 200, 300, 600, 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--compression", default="none", help="none | group-topk")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    curves: dict[str, list[float]] = {}
    final: dict[str, float] = {}
    peak: dict[str, float] = {}
    for name, changes in RUNS.items():
        per_seed, accs = [], []
        for seed in seeds:
            spec = JobSpec(
                agents=8, dataset="digits", compression=args.compression, rounds=args.rounds,
                eval_every=args.rounds, seed=seed, **changes,  # type: ignore[arg-type]
            )  # fmt: skip
            s = simulate(spec)
            per_seed.append([row["loss"] for row in s["rows"]])
            accs.append(s["final_accuracy"])
            peak[name] = max(row["lr"] for row in s["rows"])
        curves[name] = [statistics.mean(v) for v in zip(*per_seed, strict=True)]
        final[name] = statistics.mean(accs)
    if args.json:
        print(json.dumps({"seeds": seeds, "loss": curves, "accuracy": final, "peak_lr": peak}))
        return
    marks = [m for m in MARKS if m <= args.rounds]
    print(f"digits, MLP, 8 agents, {args.compression}, seeds {seeds}: training loss by round")
    print(f"{'':24} {'peak lr':>8} " + " ".join(f"{m:>7}" for m in marks) + f" {'test acc':>9}")
    for name, curve in curves.items():
        losses = " ".join(f"{statistics.mean(curve[max(0, m - 10) : m]):>7.3f}" for m in marks)
        print(f"{name:24} {peak[name]:>8.3f} {losses} {final[name]:>9.4f}")


if __name__ == "__main__":
    main()

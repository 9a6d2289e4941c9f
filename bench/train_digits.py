"""Digits, MLP, 4 agents, iid: dense ring vs group-top-k with and without error feedback.

The first acceptance item of the training issue, measured in one run:
- dense fp32 ring (the baseline): momentum SGD, m = 0.9, base lr 0.025;
- group-top-k 1% + error feedback, bounded ring (fedring's default: plain EF-SGD,
  no momentum, base lr 0.1);
- group-top-k 1% without error feedback (the negative control);
- group-top-k 0.1% + error feedback at G = 1024 (k = 1 per group: 0.098%), at the
  default base lr 0.1 and at 0.2 (one coordinate in 1024 moves per round, so the
  residual is applied late; a larger step catches up);
- group-top-k 1% + EF with DGC momentum correction (m = 0.9, lr 0.025), the
  former default, for comparison.
Accuracy is the mean (and min-max) of 3 seeds; bytes are per agent, frames included.

    python bench/train_digits.py [--seeds 0,1,2] [--rounds 600] [--json]
"""

from __future__ import annotations

import argparse
import json

from fedring.bench.accuracy import compare, print_table

RUNS = {
    "dense ring": {"compression": "none"},
    "group-topk 1% + EF": {"density": 0.01},
    "group-topk 1%, no EF": {"density": 0.01, "error_feedback": False},
    "group-topk 0.1% + EF": {"density": 0.001, "group_size": 1024},
    "group-topk 0.1% + EF, lr 0.2": {"density": 0.001, "group_size": 1024, "lr": 0.2},
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
    base = {"agents": 4, "dataset": "digits", "rounds": args.rounds,
            **({"lr": args.lr} if args.lr else {})}  # fmt: skip
    table = compare(base, RUNS, seeds)
    if args.json:
        out = {"seeds": seeds, "rounds": args.rounds, "lr": args.lr, "results": table}
        print(json.dumps(out, sort_keys=True))
        return
    print_table(
        f"digits, MLP, 4 agents iid, {args.rounds} rounds, "
        f"base lr {args.lr or 'auto'}, seeds {seeds}",
        table,
    )


if __name__ == "__main__":
    main()

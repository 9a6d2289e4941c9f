"""Digits, MLP, 4 agents: sync modes by bytes to 95%, and the other aggregation rules.

Measured in one run, mean of 3 seeds:
- `sync`, `local` (H = 4) and `adaptive` (AdaComm, H0 = 8) stop at 95% test
  accuracy: rounds and bytes per agent (frames included) to get there;
- `vote` (signSGD majority over the ring, EF) and `hybrid:0.9-0.5`: final accuracy
  after 600 rounds (goal >= 90%);
- `async` with agent 0 three times slower, staleness-weighted, soft sync of 2.
All runs use group-top-k 1% + EF unless said otherwise. `vote` moves every
coordinate by +-lr each round, so it needs a sign-sized step (--vote-lr).

    python bench/train_modes.py [--seeds 0,1,2] [--vote-lr 0.0005] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from fedring.config import JobSpec
from fedring.sim.runner import simulate


def runs(vote_lr: float) -> dict[str, dict[str, Any]]:
    return {
        "sync to 95%": {"target_accuracy": 0.95},
        "local H=4 to 95%": {"sync": "local", "local_steps": 4, "target_accuracy": 0.95},
        "adaptive H0=8 to 95%": {"sync": "adaptive", "local_steps": 8, "target_accuracy": 0.95},
        "vote (dense signs)": {"aggregation": "vote", "compression": "none", "lr": vote_lr},
        "hybrid:0.9-0.5": {"aggregation": "hybrid:0.9-0.5"},
        "async, agent 0 3x slower": {
            "sync": "async",
            "slow": "3:0",
            "async_wait": 2,
            "rounds": 300,
        },
    }


def measure(changes: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    results = [
        simulate(JobSpec(agents=4, dataset="digits", eval_every=5, seed=s, **changes))
        for s in seeds
    ]
    reached = [r for r in results if r["final_accuracy"] >= 0.95]
    return {
        "accuracy_mean": statistics.mean(r["final_accuracy"] for r in results),
        "accuracy_min": min(r["final_accuracy"] for r in results),
        "rounds_mean": statistics.mean(r["rounds"] for r in results),
        "bytes_per_agent_mean": statistics.mean(r["bytes_sent_per_agent"] for r in results),
        "seeds_reaching_95": len(reached),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--vote-lr", type=float, default=0.0005)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    table = {name: measure(changes, seeds) for name, changes in runs(args.vote_lr).items()}
    if args.json:
        print(json.dumps({"seeds": seeds, "results": table}, sort_keys=True))
        return
    print(f"digits, MLP, 4 agents iid, seeds {seeds}")
    print(f"{'':26} {'accuracy mean (min)':>20} {'rounds':>7} {'bytes/agent':>12} {'>=95%':>6}")
    for name, r in table.items():
        acc = f"{r['accuracy_mean']:.4f} ({r['accuracy_min']:.4f})"
        print(f"{name:26} {acc:>20} {r['rounds_mean']:>7.0f} {r['bytes_per_agent_mean']:>12,.0f} "
              f"{r['seeds_reaching_95']:>4}/{len(seeds)}")  # fmt: skip


if __name__ == "__main__":
    main()

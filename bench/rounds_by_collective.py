"""Rounds to the target by collective and N, in process: what `choose.rounds_factor`
guesses beside what the jobs took.

For each model and N it trains the same seeded job three times with `fedring simulate`'s
engine (the in-process transport: no link, so only the rounds matter): dense fp32 on the
ring, group-top-k 1% (with its DGC warm-up) on the bounded ring, and on fan-out. Each
stops at the model's target accuracy (evaluated every `--eval-every` rounds), so a row
reads the rounds each needed, the measured ratios, and the prior's:

    ring / fanout measured  against  rounds_factor(ring) / rounds_factor(fanout)

The lab grid's jobs are these (`fedring bench grid`: seed 0, 1%, the same targets); the
in-process run gave the grid's rounds at N = 8 and within 10% at N = 4. One job is one
seed: rounds come in steps of `--eval-every`.

    python bench/rounds_by_collective.py [--agents 2 4 8 16]
        [--model mnist1d/cnn digits/mlp] [--json]

About 10 minutes for the default on a 2-core machine (N = 16's ring: 2.5 min).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fedring.bench.lab_grid import EVAL_EVERY, FEDRING, TARGETS
from fedring.choose import rounds_factor
from fedring.config import JobSpec
from fedring.sim.runner import simulate

# the lab grid's jobs: its targets, evaluation periods and methods
PLANS = {plan: {"collective": "ring", **FEDRING[plan]} for plan in ("dense", "ring", "fanout")}


def rounds_to_target(agents: int, model: str, plan: str, seed: int) -> int | None:
    dataset, _, net = model.partition("/")
    target, every = TARGETS[dataset], EVAL_EVERY[dataset]
    spec = JobSpec.from_mapping({"agents": agents, "dataset": dataset, "model": net,
                                 "rounds": 100_000, "eval_every": every,
                                 "target_accuracy": target, "seed": seed,
                                 "topology": "ring", **PLANS[plan]})  # fmt: skip
    summary = simulate(spec)
    reached = summary["final_accuracy"] >= target
    return int(summary["rounds"]) if reached else None


def prior(agents: int, model: str) -> float:
    """The ring's rounds over fan-out's, as `auto` prices them (group-top-k 1%)."""
    dataset, _, net = model.partition("/")
    spec = JobSpec.from_mapping({"agents": agents, "dataset": dataset, "model": net,
                                 "rounds": 100_000, "compression": "group-topk",
                                 "density": 0.01, "topology": "ring"})  # fmt: skip
    return rounds_factor(spec, "ring") / rounds_factor(spec, "fanout")


def ratio(a: int | None, b: int | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--agents", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--model", nargs="+", default=["mnist1d/cnn", "digits/mlp"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for model in args.model:
        for n in args.agents:
            got = {plan: rounds_to_target(n, model, plan, args.seed) for plan in PLANS}
            ring, fanout, dense = got["ring"], got["fanout"], got["dense"]
            rows.append({"model": model, "agents": n, **got,
                         "ring_over_fanout": ratio(ring, fanout),
                         "fanout_over_dense": ratio(fanout, dense),
                         "prior_ring_over_fanout": round(prior(n, model), 2)})  # fmt: skip
            if not args.json:
                print(rows[-1], flush=True)
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}))
        return
    print("| model | N | dense | ring | fanout | ring ÷ fanout | prior | fanout ÷ dense |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['agents']} | {r['dense']} | {r['ring']} | {r['fanout']} | "
              f"{r['ring_over_fanout']} | {r['prior_ring_over_fanout']} | "
              f"{r['fanout_over_dense']} |")  # fmt: skip


if __name__ == "__main__":
    main()

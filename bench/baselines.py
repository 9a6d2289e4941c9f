"""The two baselines on loopback: time to a target accuracy, rounds and bytes per node.

- DDP: `fedring.bench.ddp`, N gloo ranks, dense fp32 gradient all-reduce, fedring's
  dense sync lr schedule (0.025 x N, 50 warm-up steps), one step = one round;
- Flower FedAvg: `fedring.bench.flower_fedavg`, a SuperLink and N SuperNodes, dense
  fp32 models both ways, one local epoch per round at lr 0.1;
- for reference, fedring's dense ring simulated in-process (rounds only: its
  time is not comparable, nothing crosses a network).

Every process starts through `fedring.bench.launch.local_launch`; the edge lab runs
the same functions with its namespace launcher. Bytes are per node and per
direction: DDP's analytic ring figure 2 (N-1)/N x params x 4 per step, Flower's
message sizes as its ServerApp counts them (uplink per client).

    python bench/baselines.py [--clients 4] [--target 0.95] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from fedring.bench.ddp import run_ddp
from fedring.bench.flower_fedavg import run_flower_fedavg
from fedring.bench.launch import local_host, local_launch
from fedring.config import JobSpec
from fedring.sim.runner import simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n, common = args.clients, {"dataset": args.dataset, "target": args.target, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="fedring-baselines-") as tmp:
        ddp = run_ddp(n, local_launch, local_host, rounds=600, eval_every=5,
                      out=Path(tmp) / "ddp", timeout_s=600, **common)  # fmt: skip
        fedavg = run_flower_fedavg(n, local_launch, local_host, rounds=30,
                                   out=Path(tmp) / "fedavg", timeout_s=900, **common)  # fmt: skip
    ring = simulate(JobSpec(agents=n, dataset=args.dataset, compression="none", eval_every=5,
                            target_accuracy=args.target, seed=args.seed))  # fmt: skip
    rows: dict[str, dict[str, Any]] = {
        "DDP gloo (dense)": {**_row(ddp), "bytes_per_node": ddp["ranks"][0]["tx_bytes"]},
        "Flower FedAvg (dense)": {
            **_row(fedavg), "bytes_per_node": fedavg["uplink_bytes_per_client"],
        },
        "fedring dense ring, in-process": {
            "seconds_to_target": None, "rounds": ring["rounds"],
            "final_accuracy": ring["final_accuracy"], "bytes_per_node": None,
        },
    }  # fmt: skip
    if args.json:
        print(json.dumps({"clients": n, "target": args.target, "runs": rows}, sort_keys=True))
        return
    print(f"{args.dataset}, MLP, {n} nodes iid, loopback; time to {args.target} test accuracy")
    print(f"{'':32} {'s to target':>11} {'rounds':>6} {'accuracy':>8} {'sent B/node':>12}")
    for name, r in rows.items():
        t = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.2f}"
        b = "-" if r["bytes_per_node"] is None else f"{r['bytes_per_node']:,.0f}"
        print(f"{name:32} {t:>11} {r['rounds']:6d} {r['final_accuracy']:8.4f} {b:>12}")


def _row(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in ("seconds_to_target", "rounds", "final_accuracy")}


if __name__ == "__main__":
    main()

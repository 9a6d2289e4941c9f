"""fedring over Flower against plain Flower FedAvg, measured in one run.

Digits, MLP (17,226 parameters), iid shards, the same initial model and the same
local work on every client (H = 12 momentum-SGD steps of 32 samples, lr 0.05):

- plain Flower FedAvg (`examples/flower_app` without its four fedring lines): dense
  fp32 models both ways;
- the same app with the four fedring lines (import and add `group_topk_mod`, import and
  wrap the strategy in `CompressedUplinks`);
- fedring's ServerApp (`fedring flower simulate`): compressed star, group-top-k 1%
  fp16 + error feedback on the uplink, FedAvgM (server momentum 0.5), dense delta down;
- fedring's best configuration: the same star run longer (`--fedring-long-rounds`),
  beside a single machine trained on all the data (in-process, no Flower).

Bytes are what Flower moves per client, counted on the deflated message objects
(metadata, record keys and fedring frame headers included): `uplink` is what a
client sends, `downlink` what it receives. Ratios are FedAvg's uplink bytes
divided by the other run's.

    python bench/flower_vs_fedavg.py [--clients 8] [--rounds 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from fedring.config import JobSpec
from fedring.flower.job import FlowerJob
from fedring.flower.simulation import simulate, simulate_apps
from fedring.sim.runner import simulate as simulate_in_process

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flower_app"
KEYS = ("final_accuracy", "rounds", "uplink_bytes_per_client", "downlink_bytes_per_client",
        "wall_seconds")  # fmt: skip


def star(clients: int, rounds: int, out: Path) -> dict[str, Any]:
    spec = JobSpec(agents=clients, dataset="digits", topology="star", sync="local",
                   local_steps=12, lr=0.05, rounds=rounds, eval_every=5)  # fmt: skip
    return simulate(FlowerJob(spec), out, timeout_s=1200)


def example(variant: str, clients: int, rounds: int, out: Path) -> dict[str, Any]:
    env = {"PYTHONPATH": str(EXAMPLE), "FEDRING_FLOWER_ROUNDS": str(rounds),
           "FEDRING_FLOWER_CLIENTS": str(clients)}  # fmt: skip
    return simulate_apps(f"flower_app.metered:{variant}_server",
                         f"flower_app.metered:{variant}_client", clients, out,
                         timeout_s=1200, env=env)  # fmt: skip


def single_machine() -> dict[str, Any]:
    """One machine, all the data, dense momentum SGD, 600 steps (fedring simulate, N = 1)."""
    r = simulate_in_process(JobSpec(agents=1, dataset="digits", compression="none", rounds=600))
    return {"final_accuracy": r["final_accuracy"], "rounds": r["rounds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--fedring-long-rounds", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedring-bench-") as tmp:
        t = Path(tmp)
        runs = {
            "plain Flower FedAvg (dense)": example("plain", args.clients, args.rounds, t / "p"),
            "FedAvg + four fedring lines": example(
                "compressed", args.clients, args.rounds, t / "c"
            ),
            "fedring ServerApp, star": star(args.clients, args.rounds, t / "s"),
            f"fedring star, {args.fedring_long_rounds} rounds": star(
                args.clients, args.fedring_long_rounds, t / "l"
            ),
        }
    base = runs["plain Flower FedAvg (dense)"]
    result: dict[str, Any] = {"clients": args.clients, "runs": {}}
    for name, r in runs.items():
        row = {k: r[k] for k in KEYS}
        row["uplink_ratio_vs_fedavg"] = (
            base["uplink_bytes_per_client"] / r["uplink_bytes_per_client"]
        )
        row["accuracy_vs_fedavg_pp"] = 100 * (r["final_accuracy"] - base["final_accuracy"])
        result["runs"][name] = row
    result["single_machine"] = single_machine()
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return
    print(f"digits, MLP, {args.clients} clients, Flower simulation engine; bytes per client")
    cols = ("acc", "vs FedAvg", "rounds", "uplink B", "x fewer", "downlink B", "wall s")
    widths = (7, 11, 6, 11, 8, 11, 7)
    print(f"{'':34} " + " ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)))
    for name, row in result["runs"].items():
        print(f"{name:34} {row['final_accuracy']:7.4f} {row['accuracy_vs_fedavg_pp']:+9.2f}pp "
              f"{row['rounds']:6d} {row['uplink_bytes_per_client']:11,.0f} "
              f"{row['uplink_ratio_vs_fedavg']:7.1f}x {row['downlink_bytes_per_client']:11,.0f} "
              f"{row['wall_seconds']:7.1f}")  # fmt: skip
    sm = result["single_machine"]
    print(f"single machine (all data, dense, {sm['rounds']} steps): {sm['final_accuracy']:.4f}")


if __name__ == "__main__":
    main()

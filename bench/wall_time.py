"""Estimated wall time on real fleets: dense ring beside group-top-k, from the same runs.

Trains digits (MLP, 8 agents, iid) twice on this machine — dense fp32 ring and
group-top-k 1% + error feedback — until `--target` accuracy (or `--rounds`), then
replays each run's per-round bytes through the virtual clock of `fedring.sim.fleet`
for three fleets of 8: Pi 4 on Wi-Fi, Pi 4 on Ethernet, Orin Nano on Ethernet.
"speed-up" is dense time to target / group-top-k time to target on that fleet;
below 1.0x compression does not pay there (it needs more rounds than it saves).

    python bench/wall_time.py [--agents 8] [--target 0.9] [--rounds 600] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

from fedring.config import JobSpec
from fedring.sim.fleet import estimate, measure_host, parse_fleet
from fedring.sim.runner import simulate

SCHEMES = {"dense fp32 ring": {"compression": "none"}, "group-topk 1% + EF": {"density": 0.01}}
FLEETS = ("rpi4/wifi", "rpi4/ethernet", "jetson-orin-nano/ethernet")


def run(agents: int, target: float, rounds: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    host = measure_host(JobSpec(agents=agents, dataset="digits"))  # same model and batch for both
    for scheme, changes in SCHEMES.items():
        spec = JobSpec(agents=agents, dataset="digits", rounds=rounds, target_accuracy=target,
                       **changes)  # type: ignore[arg-type]  # fmt: skip
        summary = simulate(spec)
        for fleet in FLEETS:
            est = estimate(spec, copy.deepcopy(summary), parse_fleet(f"{fleet}:{agents}"), host)
            results.append({"scheme": scheme, "fleet": fleet, "rounds": summary["rounds"],
                            "final_accuracy": summary["final_accuracy"],
                            "bytes_per_round": summary["bytes_sent_per_agent"] / summary["rounds"],
                            **est})  # fmt: skip
    return {"agents": agents, "target": target, "host_step_ms": host.step_s * 1000,
            "host_gflops_1thread": host.gflops, "rows": results}  # fmt: skip


def print_table(r: dict[str, Any]) -> None:
    print(f"digits MLP, {r['agents']} agents, time to accuracy {r['target']} (virtual clock)")
    head = f"{'fleet':28} {'scheme':20} {'rounds':>6} {'B/round':>9} "
    head += f"{'compute s/rd':>12} {'comm s/rd':>10} {'to target s':>12} {'speed-up':>9}"
    print(head)
    dense = {row["fleet"]: row for row in r["rows"] if row["scheme"].startswith("dense")}
    for row in r["rows"]:
        t, base = row["sim_seconds_to_target"], dense[row["fleet"]]["sim_seconds_to_target"]
        speed = f"{base / t:.2f}x" if t and base else "-"
        print(f"{row['fleet']:28} {row['scheme']:20} {row['rounds']:>6} "
              f"{row['bytes_per_round']:>9,.0f} {row['sim_compute_seconds_per_round']:>12.4f} "
              f"{row['sim_comm_seconds_per_round']:>10.4f} "
              f"{'not reached' if t is None else f'{t:.2f}':>12} {speed:>9}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    r = run(args.agents, args.target, args.rounds)
    if args.json:
        print(json.dumps(r, sort_keys=True))
    else:
        print_table(r)


if __name__ == "__main__":
    main()

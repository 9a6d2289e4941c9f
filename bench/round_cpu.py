"""CPU time of a compressed sync round against a dense one, in-process.

Runs `fedring simulate`'s job (default: 4 agents, MNIST-1D, the paper's CNN) twice
in this process, group-top-k 1% + error feedback and its dense fp32 twin (what
`fedring simulate --with-dense` trains beside it), and
reads the process's CPU clock (`time.process_time`: every agent thread, plus the
frames' encode and decode) at the end of every round. Setup (data, shards, the
initial model) and the first `--skip` rounds are left out, so a figure is CPU
seconds a round of the whole fleet, divided by the number of agents:

    cpu ms / agent / round = (cpu at round R - cpu at round skip) / (R - skip) / N

`ratio` = compressed / dense; the issue's target is at most 1.1. Both jobs use the
same seed, data and model; evaluation rounds (`--eval-every`) cost both the same.
On a shared 2-core machine the figures swing by about 10%: `--repeats` runs the
pair that many times, interleaved, and prints the median.

    python bench/round_cpu.py [--agents 4] [--dataset mnist1d] [--model cnn]
                              [--rounds 200] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from fedring.config import JobSpec
from fedring.sim.report import dense_twin
from fedring.sim.runner import simulate


def cpu_per_round(spec: JobSpec, skip: int) -> dict[str, float]:
    """CPU and wall ms per agent per round of `spec`'s rounds after the first `skip`."""
    marks: dict[int, tuple[float, float]] = {}

    def on_round(r: int, _row: dict[str, Any]) -> None:
        marks[r] = (time.process_time(), time.perf_counter())

    summary = simulate(spec, on_round=on_round)
    rounds = sorted(marks)
    first, last = rounds[min(skip, len(rounds) - 1)], rounds[-1]
    n = (last - first) * spec.agents
    cpu = (marks[last][0] - marks[first][0]) / n
    wall = (marks[last][1] - marks[first][1]) / n
    return {
        "cpu_ms": cpu * 1e3,
        "wall_ms": wall * 1e3,
        "bytes_per_agent": summary["bytes_sent_per_agent"],
        "accuracy": summary["final_accuracy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--dataset", default="mnist1d")
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--skip", type=int, default=10, help="first rounds left out (warm-up)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    spec = JobSpec.from_mapping({"agents": args.agents, "dataset": args.dataset,
                                 "model": args.model, "rounds": args.rounds,
                                 "eval_every": args.eval_every})  # fmt: skip
    jobs = {"group-topk": spec, "dense": dense_twin(spec)}  # the twin `--with-dense` trains
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in jobs}
    for _ in range(args.repeats):
        for name, spec in jobs.items():
            runs[name].append(cpu_per_round(spec, args.skip))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    ratio = med["group-topk"]["cpu_ms"] / med["dense"]["cpu_ms"]
    if args.json:
        print(json.dumps({"args": vars(args), "median": med, "runs": runs, "ratio": ratio}))
        return
    print(f"{args.agents} agents, {args.dataset}/{args.model}, rounds {args.skip}..{args.rounds}, "
          f"median of {args.repeats}")  # fmt: skip
    print("| | cpu ms / agent / round | wall ms / agent / round | bytes / agent | accuracy |")
    print("| --- | --- | --- | --- | --- |")
    for name, m in med.items():
        print(f"| {name} | {m['cpu_ms']:.2f} | {m['wall_ms']:.2f} | "
              f"{m['bytes_per_agent']:,.0f} | {m['accuracy']:.3f} |")  # fmt: skip
    print(f"ratio (compressed cpu / dense cpu): {ratio:.2f}  (target <= 1.1)")


if __name__ == "__main__":
    main()

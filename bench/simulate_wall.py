"""Wall time of `fedring simulate` end to end: compressed beside its dense baseline.

Issue 29's bar is the command a user runs,

    fedring simulate --agents 4 --dataset mnist1d --model cnn --rounds 200 --with-dense --json

whose compressed ``wall_seconds`` should be at most 1.15x its ``dense_baseline``'s
from the same run. This bench runs that command `--repeats` times (each in a fresh
process, as a user would) and prints both walls, their ratio and each run's
``setup_seconds`` (the plan: data set, shards, manifest, initial model; MNIST-1D is
generated once per process, so the compressed run, which goes first, pays it).

On a shared 2-core machine wall time swings with the other processes' load (a
woken agent thread waits for a core), so the bench also prints the CPU seconds of
the two jobs run in this process, interleaved (``time.process_time``: every agent
thread), a figure that load moves far less. `--agents-64` then times

    fedring simulate --agents 64 --dataset synthetic --json

end to end (the process, imports included) and prints its hash.

    python bench/simulate_wall.py [--repeats 3] [--cpu-pairs 3] [--agents-64] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

BAR = ["--agents", "4", "--dataset", "mnist1d", "--model", "cnn", "--rounds", "200"]
MANY = ["--agents", "64", "--dataset", "synthetic"]


def fedring(args: list[str]) -> tuple[dict[str, Any], float]:
    """`fedring simulate ARGS --json` in a fresh process: its summary and the
    process's wall seconds (start-up and imports included)."""
    cmd = [sys.executable, "-m", "fedring", "simulate", *args, "--json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout), wall


def cli_rows(repeats: int) -> list[dict[str, Any]]:
    """The bar command `repeats` times: compressed and dense walls from each run."""
    rows = []
    for _ in range(repeats):
        s, process = fedring([*BAR, "--with-dense"])
        d = s["dense_baseline"]
        rows.append({
            "compressed_wall_s": s["wall_seconds"], "dense_wall_s": d["wall_seconds"],
            "ratio": s["wall_seconds"] / d["wall_seconds"],
            "compressed_setup_s": s.get("setup_seconds"), "dense_setup_s": d.get("setup_seconds"),
            "process_s": process, "hash": s["model_hashes"][0],
        })  # fmt: skip
    return rows


def cpu_rows(pairs: int) -> list[dict[str, Any]]:
    """CPU seconds of the bar's two jobs in this process, interleaved, after one
    untimed pair that pays the process's one-offs."""
    from fedring.config import JobSpec
    from fedring.sim.report import dense_twin
    from fedring.sim.runner import simulate

    spec = JobSpec.from_mapping({"agents": 4, "dataset": "mnist1d", "model": "cnn", "rounds": 200})
    dense = dense_twin(spec)

    def cpu(job: JobSpec) -> float:
        start = time.process_time()
        simulate(job)
        return time.process_time() - start

    cpu(spec), cpu(dense)
    rows = []
    for i in range(pairs):
        order = (spec, dense) if i % 2 == 0 else (dense, spec)
        got = {job.compression: cpu(job) for job in order}
        c, d = got[spec.compression], got["none"]
        rows.append({"compressed_cpu_s": c, "dense_cpu_s": d, "ratio": c / d})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the bar command")
    ap.add_argument("--cpu-pairs", type=int, default=3, help="in-process pairs (0: none)")
    ap.add_argument("--agents-64", action="store_true", help="also time 64 agents")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {"cli": cli_rows(args.repeats), "cpu": cpu_rows(args.cpu_pairs)}
    if args.agents_64:
        s, process = fedring(MANY)
        out["agents_64"] = {
            "process_s": process, "wall_s": s["wall_seconds"],
            "hash": s["model_hashes"][0], "accuracy": s["final_accuracy"],
        }  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print("bar command (fresh process each): compressed wall_seconds vs dense_baseline")
    for r in out["cli"]:
        print(f"  ours {r['compressed_wall_s']:6.2f} s  dense {r['dense_wall_s']:6.2f} s  "
              f"ratio {r['ratio']:.2f}  (setup {r['compressed_setup_s']:.2f} / "
              f"{r['dense_setup_s']:.2f} s, process {r['process_s']:.1f} s, "
              f"hash {r['hash'][:8]})")  # fmt: skip
    if out["cli"]:
        print(f"  median ratio {statistics.median(r['ratio'] for r in out['cli']):.2f}")
    if out["cpu"]:
        print("same jobs in this process, CPU seconds (interleaved):")
        for r in out["cpu"]:
            print(f"  ours {r['compressed_cpu_s']:6.2f} s  dense {r['dense_cpu_s']:6.2f} s  "
                  f"ratio {r['ratio']:.2f}")  # fmt: skip
        print(f"  median ratio {statistics.median(r['ratio'] for r in out['cpu']):.2f}")
    if "agents_64" in out:
        a = out["agents_64"]
        print(f"64 agents, synthetic: process {a['process_s']:.1f} s, wall_seconds "
              f"{a['wall_s']:.1f} s, accuracy {a['accuracy']:.4f}, "
              f"hash {a['hash'][:8]}")  # fmt: skip


if __name__ == "__main__":
    main()

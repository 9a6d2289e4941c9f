"""Digits, mlp:512x512: a 2 x 2 pipeline grid (S = 2 stages x D = 2 replicas) beside
pure data parallelism over the same 4 agents, from one run.

- pipeline, group-top-k 1% + EF: each stage's 2 replicas all-reduce that stage's
  gradient in their own bounded ring (fedring's default codec: fp16 values, G = 256);
- pipeline, dense: the same grid with dense fp32 stage rings (the baseline the
  acceptance compares against: accuracy within 1 pp);
- data parallel, 4 agents, group-top-k 1% + EF and dense: the model fits one board
  here, so plain data parallelism is the reference for bytes and throughput.

Bytes are per agent as they left its endpoint (frames included); the pipeline's are
split into payload between stages (activations forward, gradients backward, fp32)
and payload in the stage rings. A pipeline replica trains on batch_size rows per
step (cut into M micro-batches), a data-parallel agent on batch_size rows, so the
grid's global batch is D x 32 = 64 against 4 x 32 = 128. Throughput on this host
is samples per second of training wall time with every worker taking turns on its
2 cores (so it measures total work, not parallelism); "est. parallel" replays the
schedule with each stage's measured forward/backward seconds as if every worker
had a machine of its own (transfers not timed). Bubble: idle fraction of a step.

    python bench/pipeline.py [--rounds 600] [--seeds 0] [--schedule 1f1b] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from fedring.config import JobSpec
from fedring.sim.runner import simulate

RUNS: dict[str, dict[str, Any]] = {
    "pipeline 2x2, group-topk 1% + EF": {"pipeline_stages": 2, "density": 0.01},
    "pipeline 2x2, dense": {"pipeline_stages": 2, "compression": "none"},
    "data parallel 4, group-topk 1% + EF": {"density": 0.01},
    "data parallel 4, dense": {"compression": "none"},
}


def run(base: dict[str, Any], fields: dict[str, Any], seed: int) -> dict[str, Any]:
    spec = JobSpec.from_mapping({**base, **fields, "seed": seed})
    r = simulate(spec)
    piped = spec.pipeline_stages > 1
    samples = r["rounds"] * spec.batch_size * (spec.agents // spec.pipeline_stages)
    return {
        "accuracy": r["final_accuracy"],
        "bytes_per_agent": r["bytes_sent_per_agent"],
        "pipeline_payload": r.get("pipeline_payload_bytes_per_agent", 0.0),
        "ring_payload": r.get("ring_payload_bytes_per_agent"),
        "bubble": r.get("bubble_fraction", 0.0),
        "samples_per_s_host": r["throughput_samples_per_s"] if piped
        else samples / r["wall_seconds"],
        "samples_per_s_parallel_est": r.get("throughput_estimate_samples_per_s"),
        "wall_s": r["wall_seconds"],
        "plan": r.get("plan_text", ""),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    base = {"agents": 4, "dataset": "digits", "model": "mlp:512x512", "rounds": args.rounds,
            "pipeline_schedule": args.schedule, "micro_batches": args.micro_batches}  # fmt: skip
    results = {name: [run(base, fields, s) for s in seeds] for name, fields in RUNS.items()}
    if args.json:
        print(json.dumps({"base": base, "seeds": seeds, "results": results}, sort_keys=True))
        return
    print(results[next(iter(RUNS))][0]["plan"])
    print(f"\ndigits, mlp:512x512, {args.rounds} rounds, {args.schedule}, "
          f"M = {args.micro_batches}, seeds {seeds} (means)")  # fmt: skip
    head = ("run", "accuracy", "bytes/agent", "between stages", "stage rings", "bubble",
            "samples/s host", "est. parallel")  # fmt: skip
    print(f"{head[0]:<38}" + "".join(f"{h:>15}" for h in head[1:]))
    for name, rows in results.items():
        def mean(key: str, rows: list[dict[str, Any]] = rows) -> float | None:
            values = [r[key] for r in rows]
            return None if values[0] is None else statistics.mean(values)

        cells = [f"{mean('accuracy'):.4f}", f"{mean('bytes_per_agent'):,.0f}",
                 f"{mean('pipeline_payload'):,.0f}",
                 "-" if mean("ring_payload") is None else f"{mean('ring_payload'):,.0f}",
                 f"{mean('bubble'):.3f}", f"{mean('samples_per_s_host'):,.0f}",
                 "-" if mean("samples_per_s_parallel_est") is None
                 else f"{mean('samples_per_s_parallel_est'):,.0f}"]  # fmt: skip
        print(f"{name:<38}" + "".join(f"{c:>15}" for c in cells))
    sparse, dense = (statistics.mean(r["accuracy"] for r in results[k]) for k in list(RUNS)[:2])
    print(f"\npipeline: group-topk 1% + EF minus dense = {100 * (sparse - dense):+.2f} pp")


if __name__ == "__main__":
    main()

"""What the per-round checkpoint costs a round in the edge lab: `checkpoint_every = 1`
(the default, `examples/digits.toml`) beside no checkpoint until the end, same run.

Each collective runs the same job twice over the lab's shaped links (network
namespaces, tc tbf, the delay proxy; needs root): once checkpointing every round, once
only at the end (`checkpoint_every = rounds`). "ms/round" is the job's training
seconds over its rounds; "cost" is the first over the second. The head runs one
checkpoint ahead of the last saved (`edge_agent.running.Running.gate`), so the
checkpoint's patches, ack round trip and save overlap the next round; before that it
waited for each round's ack, a further broker round trip a round.

    sudo .venv/bin/python bench/checkpoint_gate.py [--delay-ms 20] [--rounds 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def lab(collective: str, every: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    job = tmp / f"ck{every}.toml"
    job.write_text(f"[job]\ncheckpoint_every = {every}\n")
    out = tmp / f"{collective}-ck{every}"
    cmd = [sys.executable, "-m", "fedring", "lab", "run", "--agents", str(args.agents),
           "--bandwidth", str(args.bandwidth), "--delay-ms", str(args.delay_ms),
           "--rounds", str(args.rounds), "--model", args.model, "--collective", collective,
           "--job", str(job), "--out", str(out), "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--bandwidth", type=float, default=10.0)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--model", default="mlp:512x512")
    ap.add_argument("--collective", nargs="+", default=["fanout", "ring"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for collective in args.collective:
            runs = {every: lab(collective, every, args, Path(tmp)) for every in (1, args.rounds)}
            ms = {e: 1e3 * float(r["training_seconds"]) / args.rounds for e, r in runs.items()}
            rows.append({
                "collective": collective, "ms_per_round_every_round": round(ms[1], 1),
                "ms_per_round_at_end": round(ms[args.rounds], 1),
                "cost": round(ms[1] / ms[args.rounds], 3),
                "identical_models": all(r["identical_models"] for r in runs.values()),
                "final_accuracy": [r["final_accuracy"] for r in runs.values()],
            })  # fmt: skip
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}))
        return
    print(f"{args.agents} agents, {args.model}, {args.bandwidth:g} Mbit/s, "
          f"{args.delay_ms:g} ms each way, {args.rounds} rounds")  # fmt: skip
    print("| collective | ms/round, checkpoint every round | ms/round, at the end | cost |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['collective']} | {r['ms_per_round_every_round']} | "
              f"{r['ms_per_round_at_end']} | {r['cost']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()

"""The same 4-member job in one process (`fedring.local_group`, threads) and in four
processes over a real Mosquitto (`fedring.connect`): wall time side by side.

The job is examples/library_digits.py's: the default MLP on digits, group-top-k 1%
with error feedback, plain SGD at 0.1 scaled x4 with a 50-step warm-up, an
evaluation every 10 steps, `--rounds` steps (or until `--target` accuracy, as the
example stops). Both runs are seeded alike, so they take the same steps and end on
the same parameters (the sha256 is printed for each).

"training" is from the moment the last member finished its first WARMUP steps
(one evaluation included: the first optimizer step and evaluation import ~1 s of
torch and scipy modules, once per process; processes launched together start
seconds apart here, and the early ones wait in their first collective) to the last
member's last step; "launch" adds what
comes before: over MQTT, starting the four Python processes, importing torch,
`connect` and each member's setup. "cpu s" is the CPU time the members' processes
spent on their steps (user + system, all threads), and the broker's for the whole
run: where wall time exceeds it, members were waiting for a core or for a frame.
ratio = MQTT training wall / in-process training wall (1.0: the broker costs
nothing). The broker has examples/mosquitto.conf's transport settings
(``set_tcp_nodelay true``, the message and queue limits), without its users, ACL and
persistence; ``--no-nodelay`` leaves ``set_tcp_nodelay`` out, as a default
Mosquitto does.

    python bench/connect_wall.py [--rounds 300] [--target ACC] [--no-nodelay] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import fedring
from fedring.training.models import params_sha256
from fedring.transport.mosquitto import Mosquitto

AGENTS, BATCH, LR, SEED = 4, 32, 0.1, 0
WARMUP = 10  # steps before the clock starts (see the module docstring)
KEY = b"connect_wall bench"


def train(group: fedring.Group, rank: int, rounds: int, target: float | None) -> dict[str, Any]:
    """One member's part of the job; its steps, its final parameters' sha256, its clock."""
    plan = fedring.plan(fedring.ClassificationTask("digits", "mlp"), agents=AGENTS, seed=SEED)
    task = plan.task
    model, x, y = fedring.prepare(
        task, plan.dataset, plan.manifest, plan.shards[rank], rank, seed=SEED,
        model_sha256=plan.model_sha256, initial=plan.initial,
    )  # fmt: skip
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    settings = fedring.ReducerSettings(density=0.01, density_warmup=10)
    numel = sum(p.numel() for p in model.parameters())
    reducer = fedring.Reducer(group.collective, numel, settings)
    opt = fedring.DistributedOptimizer(inner, reducer, model=model, weight=plan.weights[rank])
    scaling = fedring.LinearScaling(inner, world=AGENTS, batch_size=BATCH, warmup_steps=50)
    sampler = fedring.ShardSampler(len(x), batch_size=BATCH, seed=SEED, rank=rank)
    started, cpu, steps = time.time(), time.process_time(), 0  # reset after WARMUP steps
    try:
        for step in range(rounds):
            scaling.apply(step)
            idx = torch.tensor(sampler.next_batch())
            model.train()
            opt.zero_grad()
            task.loss(model(x[idx]), y[idx]).backward()
            opt.step()
            steps = step + 1
            accuracy = task.evaluate(model, plan.dataset)[1] if steps % 10 == 0 else 0.0
            if steps == WARMUP:
                started, cpu = time.time(), time.process_time()
            if target is not None and accuracy >= target:
                break  # every member holds the same parameters: all stop at the same step
    finally:
        opt.close()
    return {"rank": rank, "steps": steps, "sha256": params_sha256(model), "started": started,
            "ended": time.time(), "cpu_s": time.process_time() - cpu}  # fmt: skip


def in_process(rounds: int, target: float | None) -> dict[str, Any]:
    torch.set_num_threads(1)  # four member threads
    fedring.plan(fedring.ClassificationTask("digits", "mlp"), agents=AGENTS, seed=SEED)  # warm
    launched = time.time()
    groups = fedring.local_group(AGENTS)
    with ThreadPoolExecutor(AGENTS) as pool:
        rows = list(pool.map(lambda r: train(groups[r], r, rounds, target), range(AGENTS)))
    for row in rows[1:]:  # one process: its CPU time, once
        row["cpu_s"] = 0.0
    return summary(rows, launched)


def over_mqtt(rounds: int, target: float | None, nodelay: bool) -> dict[str, Any]:
    with Mosquitto(nodelay=nodelay) as broker:
        launched = time.time()
        until = [] if target is None else ["--target", str(target)]
        procs = [subprocess.Popen([sys.executable, __file__, "--member", str(rank), "--broker",
                                   broker.url, "--rounds", str(rounds), *until],
                                  stdout=subprocess.PIPE, text=True)
                 for rank in range(AGENTS)]  # fmt: skip
        try:
            outs = [p.communicate(timeout=600)[0] for p in procs]
        finally:
            for p in procs:  # by PID, whatever happened
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a member failed: exit codes {[p.returncode for p in procs]}")
        broker_cpu = _cpu_s(broker.pid)
    rows = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return {**summary(rows, launched), "broker_cpu_s": broker_cpu}


def member(rank: int, broker: str, rounds: int, target: float | None) -> None:
    """One process of the MQTT run: connect, train, print one JSON line."""
    torch.set_num_threads(1)
    with fedring.connect(broker, job="wall", agent_id=f"agent-{rank}", world=AGENTS, key=KEY,
                         timeout_s=60.0) as group:  # fmt: skip
        row = train(group, group.rank, rounds, target)
        row["broker_nagle"] = group.link.broker_nagle
    print(json.dumps(row))


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (Linux; 0.0 where unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(rows: list[dict[str, Any]], launched: float) -> dict[str, Any]:
    ended = max(r["ended"] for r in rows)
    return {"training_s": ended - max(r["started"] for r in rows), "launch_s": ended - launched,
            "cpu_s": sum(r["cpu_s"] for r in rows),
            "steps": sorted({r["steps"] for r in rows}),
            "sha256": sorted({r["sha256"][:16] for r in rows}),
            "broker_nagle": sorted({str(r.get("broker_nagle")) for r in rows})}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--target", type=float, help="stop at this test accuracy (default: never)")
    parser.add_argument(
        "--no-nodelay",
        action="store_true",
        help="a broker without set_tcp_nodelay (Nagle on its writes)",
    )
    parser.add_argument("--json", action="store_true", help="the JSON line only")
    parser.add_argument("--member", type=int, help=argparse.SUPPRESS)  # one MQTT process
    parser.add_argument("--broker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member is not None:
        member(args.member, args.broker, args.rounds, args.target)
        return
    local = in_process(args.rounds, args.target)
    mqtt = over_mqtt(args.rounds, args.target, nodelay=not args.no_nodelay)
    ratio = mqtt["training_s"] / local["training_s"]
    if not args.json:
        broker = "without set_tcp_nodelay" if args.no_nodelay else "set_tcp_nodelay true"
        print(
            f"digits MLP, {AGENTS} members, group-top-k 1%, up to {args.rounds} steps, "
            f"target {args.target or 'none'}; Mosquitto {broker}"
        )
        print(f"{'run':28} {'steps':>6} {'training s':>11} {'cpu s':>6} {'broker cpu s':>13} "
              f"{'launch s':>9}  sha256")  # fmt: skip
        for name, r in (("in-process (local_group)", local), ("4 processes (connect)", mqtt)):
            print(f"{name:28} {','.join(map(str, r['steps'])):>6} {r['training_s']:>11.2f} "
                  f"{r['cpu_s']:>6.2f} {r.get('broker_cpu_s', 0.0):>13.2f} "
                  f"{r['launch_s']:>9.2f}  {','.join(r['sha256'])}")  # fmt: skip
        print(
            f"ratio (MQTT training / in-process training): {ratio:.2f}x "
            f"(broker_nagle seen by the members: {','.join(mqtt['broker_nagle'])})"
        )
    print(json.dumps({"bench": "connect_wall", "rounds": args.rounds, "target": args.target,
                      "nodelay": not args.no_nodelay, "in_process": local, "mqtt": mqtt,
                      "ratio": round(ratio, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()

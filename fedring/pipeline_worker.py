"""One pipeline stage in its own process, its frames through a real MQTT broker.

S processes, one per stage, train one model together: each builds only its own
stage's layers (`pipeline.materialize`), draws the same seeded batches, and sends
activations forward and their gradients back as signed, hash-checked frames over
an MQTT link (`transport.mqtt`). Every process is given the same job flags and its
own ``--stage``; the cut points are planned alike in each (balanced by parameter
count, or ``--starts``) and the plan's memory estimate is checked against the
board's budget before anything is allocated.

    python -m fedring.pipeline_worker --broker mqtt://127.0.0.1:1883 --job demo \\
        --stages 3 --stage 0 --model mlp:2048x2048x2048x2048 --board rpi3 --out run/

At the end each process writes ``stage{i}.pt`` (its layers' state_dict) under
``--out`` and prints one JSON line: its layers, parameters, peak RSS (VmHWM) beside
the board's budget, bytes sent, wall time, and the last stage's final loss. A
neighbour that dies or stays silent ends the run at the deadline (``--timeout-s``)
with a typed error on stderr and exit status 3; nothing waits without one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.counters import Counters
from fedring.engine.group import LOCAL_KEY
from fedring.engine.reducer import ReducerSettings
from fedring.engine.sampler import ShardSampler
from fedring.firmware_profiles.schema import load_builtin
from fedring.pipeline.grid import PipelineSettings, ShardBatches, build_worker, worker_name
from fedring.pipeline.materialize import balanced_starts, materialize, meta_layers, traced_costs
from fedring.pipeline.memory import peak_rss_mb, return_freed_memory
from fedring.pipeline.partition import Board, StagePlan, split_at
from fedring.pipeline.stage import WireSettings
from fedring.training.datasets import load_dataset
from fedring.transport.base import Deadline, TransportError
from fedring.transport.mqtt import BrokerConfig, MqttLink

EXIT_NEIGHBOUR = 3  # a neighbour died, left or stayed silent past the deadline
EXIT_USAGE = 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedring.pipeline_worker",
        description="Train one stage of a pipeline over an MQTT broker. Start one process "
        "per stage (--stage 0 .. --stages-1) with the same job flags; they wait for each "
        "other (--timeout-s), train --steps steps, and each writes its stage's weights.",
        epilog="example (three shells): python -m fedring.pipeline_worker --broker "
        "mqtt://127.0.0.1:1883 --job j1 --stages 3 --stage I --model mlp:2048x2048x2048x2048 "
        "--board rpi3 --steps 300 --out run/",
    )  # fmt: skip
    a = p.add_argument
    a("--broker", required=True, help="mqtt://HOST:PORT or mqtts://HOST:PORT")
    a("--job", required=True, help="job id: the topic every stage of this run shares")
    a("--stages", type=int, required=True, help="S, the number of stage processes")
    a("--stage", type=int, required=True, help="this process's stage, 0 .. S-1")
    a("--model", default="mlp:2048x2048x2048x2048", help="model spec (fedring.training.models)")
    a("--dataset", default="digits", help="dataset spec (fedring.training.datasets)")
    a("--starts", default="", help="layer where each stage starts, e.g. 0,4,6 (default: "
      "balanced by parameter count)")  # fmt: skip
    a("--board", default="rpi3", help="firmware profile whose ram_budget_mb each stage must fit")
    a("--steps", type=int, default=300, help="training steps (batches)")
    a("--batch-size", type=int, default=32, help="rows per step")
    a("--micro-batches", type=int, default=4, help="M: micro-batches per step")
    a("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    a("--activation-dtype", choices=("fp32", "fp16"), default="fp32")
    a("--lr", type=float, default=0.05, help="SGD learning rate")
    a("--seed", type=int, default=0, help="data split, batch order and weights")
    a("--timeout-s", type=float, default=30.0, help="deadline of every wait for a neighbour")
    a("--out", type=Path, default=Path("."), help="where stage{i}.pt goes")
    return p


def plan_of(args: argparse.Namespace, layers: Sequence[torch.nn.Module],
            feature_shape: tuple[int, ...]) -> StagePlan:  # fmt: skip
    """The same plan in every process: traced shapes, the given or balanced cuts, and
    the board's budget checked against each stage's memory estimate."""
    rows = -(-args.batch_size // args.micro_batches)
    costs = traced_costs(layers, feature_shape, rows)
    starts = ([int(v) for v in args.starts.split(",")] if args.starts
              else balanced_starts(costs, args.stages))  # fmt: skip
    board = Board.of(load_builtin(args.board))
    return split_at(costs, [board] * args.stages, starts, micro_batches=args.micro_batches,
                    schedule=args.schedule, input_bytes=rows * 4 * math.prod(feature_shape),
                    host_gflops=1.0)  # fmt: skip


def wait_for_neighbours(link: MqttLink, job: str, names: Sequence[str], deadline: Deadline) -> None:
    """Until every neighbour announces itself in `job`; `CollectiveError`-free: a
    `TransportError` names who never came."""
    while not deadline.expired:
        if set(names) <= set(link.peers_in(job)):
            return
        time.sleep(0.05)
    missing = sorted(set(names) - set(link.peers_in(job)))
    raise TransportError(f"neighbours {missing} did not join job {job!r} before the deadline")


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    torch.set_num_threads(1)
    data = load_dataset(args.dataset, seed=args.seed)
    layers = meta_layers(args.model, data.feature_shape, data.num_classes)
    plan = plan_of(args, layers, data.feature_shape)
    spec = plan.stages[args.stage]
    module = materialize(layers, spec.start, spec.end, seed=args.seed)
    s, count = args.stage, args.stages
    me = worker_name(s, 0)
    counters = Counters()
    link = MqttLink(BrokerConfig.parse(args.broker), me, job=args.job, counters=counters)
    link.connect()
    try:
        neighbours = [worker_name(i, 0) for i in (s - 1, s + 1) if 0 <= i < count]
        wait_for_neighbours(link, args.job, neighbours, Deadline.after(args.timeout_s))
        print(
            f"stage {s}: layers {spec.start}..{spec.end - 1}, {spec.params:,} params; "
            f"neighbours {neighbours} present, training",
            file=sys.stderr,
            flush=True,
        )
        channel = PeerChannel(link.endpoint(args.job), args.job, key=LOCAL_KEY, counters=counters)
        wire = WireSettings(args.activation_dtype, args.timeout_s)
        settings = PipelineSettings(args.micro_batches, args.schedule, wire)
        batches = ShardBatches(data.x_train, data.y_train,
                               ShardSampler(len(data.x_train), batch_size=args.batch_size,
                                            seed=args.seed, rank=0))  # fmt: skip
        worker = build_worker(
            module, plan, s, 0, 1, settings, channel, loss_fn=F.cross_entropy,
            make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=args.lr),
            reducer_settings=ReducerSettings(compression="none"), next_batch=batches,
        )  # fmt: skip
        train_start = time.perf_counter()
        for step in range(args.steps):
            worker.train_step(step, args.lr)
        train_s = time.perf_counter() - train_start
    finally:
        link.close()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(module.state_dict(), args.out / f"stage{s}.pt")
    rss, budget = peak_rss_mb(), load_builtin(args.board).ram_budget_mb
    return {
        "stage": s, "layers": [spec.start, spec.end - 1], "params": spec.params,
        "board": args.board, "budget_mb": budget, "estimate_mb": round(spec.memory_mb, 1),
        "peak_rss_mb": round(rss, 1), "within_budget": rss <= budget,
        "bytes_sent": channel.endpoint.stats.bytes_sent,
        "payload_bytes_sent": worker.stage.payload_bytes_sent,
        "train_seconds": round(train_s, 2), "wall_seconds": round(time.perf_counter() - start, 2),
        "final_loss": worker.losses[-1] if worker.losses else None,
    }  # fmt: skip


def assembled_from(out: Path, args: argparse.Namespace) -> torch.nn.Sequential:
    """The whole model from the ``stage{i}.pt`` files a run of `args` wrote under `out`
    (for evaluation where the whole model fits; `torch.load(weights_only=True)`)."""
    data = load_dataset(args.dataset, seed=args.seed)
    layers = meta_layers(args.model, data.feature_shape, data.num_classes)
    plan = plan_of(args, layers, data.feature_shape)
    parts: list[torch.nn.Module] = []
    for spec in plan.stages:
        part = materialize(layers, spec.start, spec.end, seed=args.seed)
        part.load_state_dict(torch.load(out / f"stage{spec.index}.pt", weights_only=True))
        parts.extend(part)
    return torch.nn.Sequential(*parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return_freed_memory()
    if not 0 <= args.stage < args.stages:
        print(f"error: --stage {args.stage} must be in [0, {args.stages - 1}]", file=sys.stderr)
        return EXIT_USAGE
    try:
        summary = run(args)
    except (CollectiveError, TransportError) as exc:
        print(f"error: stage {args.stage}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_NEIGHBOUR
    except ValueError as exc:  # a bad spec, cut or budget: named by the message
        print(f"error: stage {args.stage}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`fedring simulate` with ``pipeline_stages`` > 1: an S x D grid in one process.

The coordinator's part is `engine.plan` over the D replicas (shards with a sha256
each, the initial parameters); every replica verifies its shard and start as a
board would (`engine.plan.prepare`). The model's layers are measured on a sample
micro-batch and cut into S stages within the boards' budgets (`pipeline.partition`;
`generic-x86_64` boards unless a fleet is given, stage s on boards s*D .. s*D+D-1).
The grid then trains over the in-process transport: activations and gradients
between stages, each stage's gradient through its replicas' ring (`pipeline.grid`).

The summary adds the plan, the bubble fraction of a step (the schedule replayed
with each stage's measured forward and backward seconds), bytes per agent split
into pipeline and ring payload, and throughput: measured on this host (all S x D
workers take turns on its cores) and estimated for S x D machines running at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fedring import build
from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.engine.plan import plan as plan_task
from fedring.engine.plan import prepare
from fedring.engine.sampler import ShardSampler
from fedring.firmware_profiles.schema import Profile, load_builtin
from fedring.pipeline.assignment import plan_from_shapes
from fedring.pipeline.cost import host_gflops, layers_of, measure_layers
from fedring.pipeline.grid import (
    Batch,
    GridWorker,
    PipelineSettings,
    ShardBatches,
    assembled,
    build_grid,
    run_steps,
)
from fedring.pipeline.partition import Board, StagePlan, partition
from fedring.pipeline.schedule import timeline
from fedring.pipeline.stage import WireSettings
from fedring.training.datasets import Dataset
from fedring.training.lr import LrSchedule
from fedring.training.models import param_count, params_sha256
from fedring.transport.inproc import InprocTransport

Grid = list[list[GridWorker]]


def stage_boards(stages: int, replicas: int, fleet: Sequence[Profile] | None) -> list[Board]:
    """Stage s runs on boards s*D .. s*D+D-1: the slowest speed and smallest budget count."""
    if fleet is None:
        return [Board.of(load_builtin("generic-x86_64"))] * stages
    boards = []
    for s in range(stages):
        own = fleet[s * replicas : (s + 1) * replicas]
        names = sorted({p.name for p in own})
        boards.append(Board("+".join(names), min(p.gflops for p in own),
                            min(p.ram_budget_mb for p in own)))  # fmt: skip
    return boards


def simulate_pipeline(
    spec: JobSpec, on_round: Callable[[int, dict[str, Any]], None] | None = None,
    on_done: Callable[[nn.Module, Dataset], None] | None = None,
    fleet: Sequence[Profile] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the job on an S x D grid; return the summary (see the module docstring)."""
    start = time.perf_counter()
    s_count = spec.pipeline_stages
    replicas = spec.agents // s_count
    task = build.task_of(spec)
    p = plan_task(task, agents=replicas, sharding=spec.sharding, seed=spec.seed)
    shards = [
        prepare(task, p.dataset, p.manifest, p.shards[d], d, seed=spec.seed,
                model_sha256=p.model_sha256, initial=p.initial)
        for d in range(replicas)
    ]  # fmt: skip
    layers = layers_of(shards[0][0])
    rows = math.ceil(min(spec.batch_size, len(shards[0][1])) / spec.micro_batches)
    sample = shards[0][1][:rows]
    torch.set_num_threads(1)
    boards = stage_boards(s_count, replicas, fleet)
    if spec.pipeline_cost == "counted":  # as the coordinator splits: the same hash anywhere
        stage_plan = plan_from_shapes(
            layers, tuple(sample.shape[1:]), boards, batch_size=min(spec.batch_size,
            len(shards[0][1])), micro_batches=spec.micro_batches,
            schedule=spec.pipeline_schedule,
        )  # fmt: skip
    else:
        stage_plan = partition(
            measure_layers(layers, sample), boards,
            micro_batches=spec.micro_batches, schedule=spec.pipeline_schedule,
            input_bytes=sample.numel() * 4, host_gflops=host_gflops(),
        )  # fmt: skip
    hub, counters = InprocTransport(cooperative=True), Counters()

    def data(d: int) -> Batch:
        x, y = shards[d][1], shards[d][2]
        return ShardBatches(x, y, ShardSampler(len(x), batch_size=spec.batch_size,
                                               seed=spec.seed, rank=d))  # fmt: skip

    settings = PipelineSettings(
        spec.micro_batches, spec.pipeline_schedule,
        WireSettings(spec.activation_dtype, spec.timeout_s),  # type: ignore[arg-type]
        spec.topology,
    )  # fmt: skip
    grid = build_grid(
        layers, stage_plan, replicas, settings, loss_fn=task.loss,
        make_optimizer=lambda m: build.optimizer(spec, task, m),
        reducer_settings=build.reducer_settings(spec), data=data, hub=hub, counters=counters,
        job="sim",
    )  # fmt: skip
    lr = LrSchedule(base_lr=spec.lr, scaling=spec.lr_scaling, n_agents=replicas,
                    batch_size=spec.batch_size, ref_batch=spec.ref_batch,
                    warmup_steps=spec.warmup_steps)  # fmt: skip
    evals, result_rows, train_s, done = _train(spec, task, p.dataset, grid, hub, lr, on_round)
    model = assembled(grid)
    summary = _summary(spec, stage_plan, grid, evals, result_rows, done, train_s)
    summary.update(wall_seconds=time.perf_counter() - start, counters=counters.snapshot(),
                   manifest=p.manifest.to_dict(), model_sha256_initial=p.model_sha256)  # fmt: skip
    if on_done is not None:
        on_done(model, p.dataset)
    return summary


def _train(
    spec: JobSpec, task: Any, dataset: Dataset, grid: Grid, hub: InprocTransport,
    lr: LrSchedule, on_round: Callable[[int, dict[str, Any]], None] | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float, int]:  # fmt: skip
    """Train `eval_every` steps at a time, evaluating the assembled model between."""
    evals: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    train_s, r = 0.0, 0
    while r < spec.rounds:
        steps = min(spec.eval_every, spec.rounds - r)
        t0 = time.perf_counter()
        run_steps(grid, start=r, steps=steps, lr_at=lr.lr_at, hub=hub)
        train_s += time.perf_counter() - t0
        workers = [w for row in grid for w in row]
        for i in range(r, r + steps):
            loss = sum(w.losses[i] for w in grid[-1]) / len(grid[-1])
            sent = sum(w.bytes_after[i] for w in workers) / len(workers)
            rows.append({"round": i, "loss": loss, "lr": lr.lr_at(i), "bytes_sent": sent})
        r += steps
        test_loss, accuracy = task.evaluate(assembled(grid), dataset)
        evals.append({"round": r - 1, "test_loss": test_loss, "accuracy": accuracy})
        rows[-1].update(test_loss=test_loss, accuracy=accuracy)
        if on_round is not None:
            on_round(r - 1, rows[-1])
        if spec.target_accuracy and accuracy >= spec.target_accuracy:
            break
    return evals, rows, train_s, r


def _mean_sent(grid: Grid) -> float:
    workers = [w for row in grid for w in row]
    return sum(w.stage.channel.endpoint.stats.bytes_sent for w in workers) / len(workers)


def _summary(
    spec: JobSpec, plan: StagePlan, grid: Grid, evals: list[dict[str, Any]],
    rows: list[dict[str, Any]], rounds: int, train_s: float,
) -> dict[str, Any]:  # fmt: skip
    workers = [w for row in grid for w in row]
    replicas, m = len(grid[0]), spec.micro_batches
    micro = rounds * m  # forwards (and backwards) each worker ran
    fwd = [sum(w.stage.forward_s for w in row) / len(row) / micro for row in grid]
    bwd = [sum(w.stage.backward_s for w in row) / len(row) / micro for row in grid]
    line = timeline(spec.pipeline_schedule, fwd, bwd, micro_batches=m)
    reduce_s = max(sum(w.reduce_s for w in row) / len(row) for row in grid) / rounds
    samples = rounds * spec.batch_size * replicas
    pp = sum(w.stage.payload_bytes_sent for w in workers) / len(workers)
    total = sum(w.stage.channel.payload_bytes_sent for w in workers) / len(workers)
    frames = sum(w.stage.channel.endpoint.stats.frames_sent for w in workers) / len(workers)
    hashes = [sorted({params_sha256(w.stage.module) for w in row}) for row in grid]
    numels = [param_count(row[0].stage.module) for row in grid]
    dense = sum(2 * (replicas - 1) / replicas * n * 4 * rounds for n in numels) / len(grid)
    rows_mb = math.ceil(spec.batch_size / m)
    width = 2 if spec.activation_dtype == "fp16" else 4
    costs = [
        {"forward_s": fwd[s], "backward_s": bwd[s],
         "ring_compute_s": sum(w.reduce_s for w in row) / len(row) / rounds,
         "ring_payload_bytes_per_step": sum(w.stage.channel.payload_bytes_sent
                                            - w.stage.payload_bytes_sent for w in row)
         / len(row) / rounds,
         "activation_bytes": rows_mb * math.prod(plan.stages[s + 1].in_shape) * width
         if s + 1 < len(plan.stages) else 0}
        for s, row in enumerate(grid)
    ]  # fmt: skip
    return {
        "final_accuracy": evals[-1]["accuracy"] if evals else 0.0,
        "rounds": rounds,
        "layout": f"pipeline {len(grid)} stages x {replicas} replicas",
        "params": sum(numels),
        "plan": plan.to_dict(),
        "plan_text": plan.describe(),
        "bytes_sent_per_agent": _mean_sent(grid),
        "frames_sent_per_agent": frames,
        "pipeline_payload_bytes_per_agent": pp,
        "ring_payload_bytes_per_agent": total - pp,
        "dense_equivalent_bytes": dense,  # the stage rings' share, as dense fp32
        "bubble_fraction": line.bubble,
        "stage_costs": costs,  # per stage, this host: seconds per micro-batch, bytes per step
        "step_seconds_estimate": line.makespan_s + reduce_s,
        "throughput_samples_per_s": samples / train_s if train_s > 0 else 0.0,
        "throughput_estimate_samples_per_s": spec.batch_size
        * replicas
        / (line.makespan_s + reduce_s),
        "identical_models": all(len(h) == 1 for h in hashes),
        "model_hashes": [h[0] for h in hashes if len(h) == 1],
        "rollbacks": 0,
        "evals": evals,
        "rows": rows,
    }

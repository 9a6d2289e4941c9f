"""`fedring simulate`: N agents in one process, real frames over the in-process transport.

The coordinator's part is done here (load and shard the data, publish a manifest
with a sha256 per shard and the initial model's hash); each agent then verifies
its shard and its initial model before training, exactly as a board would, and
runs `training.sync.run_agent` (or the async star in `sim.async_star`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from fedring.aggregation.rules import Aggregation, capped_weights
from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.collective.torus import build_ring, layout_name
from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.sim.star import serve_star
from fedring.training.datasets import Dataset, load_dataset
from fedring.training.exchange import STAR, Exchange
from fedring.training.models import build_model, param_count, params_sha256
from fedring.training.sharding import (
    ShardManifest,
    build_manifest,
    make_shards,
    shard_data,
    verify_shard,
)
from fedring.training.sync import AgentContext, AgentResult, run_agent
from fedring.training.trainer import LocalTrainer
from fedring.transport.inproc import InprocTransport

JOB_KEY = b"fedring-simulate"
TIMES = ("compute_s", "comm_s", "step_s")  # a sync round's seconds, in every row


class ModelMismatch(ValueError):
    """An agent's initial model does not hash to the manifest's."""


@dataclass
class Plan:
    """What the coordinator publishes before round 0."""

    spec: JobSpec
    dataset: Dataset
    manifest: ShardManifest
    shards: list[Any]
    model_sha256: str
    weights: list[float]


def plan(spec: JobSpec) -> Plan:
    dataset = load_dataset(spec.dataset, spec.seed)
    shards = make_shards(dataset.y_train.numpy(), spec.agents, spec.sharding, spec.seed)
    manifest = build_manifest(dataset, shards, spec.sharding, spec.seed)
    model = build_model(spec.model, dataset.feature_shape, dataset.num_classes, spec.seed)
    if Aggregation.parse(spec.aggregation).kind == "weighted":
        weights = capped_weights(manifest.sizes, spec.weight_cap).tolist()
    else:
        weights = [1.0 / spec.agents] * spec.agents
    return Plan(spec, dataset, manifest, shards, params_sha256(model), weights)


def prepare_agent(p: Plan, rank: int) -> LocalTrainer:
    """What an agent does before training: verify its shard and its initial model."""
    spec, ds = p.spec, p.dataset
    x, y = shard_data(ds, p.shards[rank])
    verify_shard(p.manifest, rank, x, y)
    model = build_model(spec.model, ds.feature_shape, ds.num_classes, spec.seed)
    got = params_sha256(model)
    if got != p.model_sha256:
        raise ModelMismatch(
            f"agent {rank}: initial model sha256 {got[:12]}... != manifest "
            f"{p.model_sha256[:12]}...; refusing to train from a different starting point"
        )
    return LocalTrainer(
        model, x, y, batch_size=spec.batch_size, momentum=spec.momentum, seed=spec.seed, rank=rank
    )


def simulate(
    spec: JobSpec,
    on_round: Callable[[int, dict[str, Any]], None] | None = None,
    on_done: Callable[[torch.nn.Module, Dataset], None] | None = None,
) -> dict[str, Any]:
    """Run the job; return a summary (see `summarise`) with per-round rows.

    `on_done` receives agent 0's trained model and the dataset (e.g. to export ONNX).
    """
    if spec.sync == "async":
        from fedring.sim.async_star import simulate_async

        return simulate_async(spec, plan(spec), on_round, on_done)
    start = time.perf_counter()
    p = plan(spec)
    trainers = [prepare_agent(p, r) for r in range(spec.agents)]
    torch.set_num_threads(1)  # N agent threads on a small machine: no intra-op oversubscription
    hub, counters = InprocTransport(cooperative=True), Counters()
    baton = hub.baton
    names = tuple(f"agent-{i}" for i in range(spec.agents))
    channels = [PeerChannel(hub.connect(n), "sim", key=JOB_KEY, counters=counters) for n in names]
    numel = param_count(trainers[0].model)
    star = Aggregation.parse(spec.aggregation).needs_star

    def agent(rank: int) -> AgentResult:
        ring = build_ring(channels[rank], names, spec.topology, spec.timeout_s)
        ctx = AgentContext(spec, trainers[rank], Exchange.build(ring, spec, numel),
                           p.dataset.x_test, p.dataset.y_test, p.weights[rank],
                           on_round if rank == 0 else None, baton=baton)  # fmt: skip
        try:
            with baton.turn() if baton else contextlib.nullcontext():
                return run_agent(ctx)
        except BaseException:
            channels[rank].endpoint.close()  # neighbours fail fast instead of waiting
            raise

    with ThreadPoolExecutor(max_workers=spec.agents + 1) as pool:
        server = None
        if star:
            centre = PeerChannel(hub.connect(STAR), "sim", key=JOB_KEY, counters=counters)
            server = pool.submit(serve_star, centre, spec, names, numel)
        futures = [pool.submit(agent, r) for r in range(spec.agents)]
        results = _gather(futures + ([server] if server else []))[: spec.agents]
    summary = summarise(
        spec, p, results, [t.model for t in trainers], channels, time.perf_counter() - start
    )
    summary["counters"] = counters.snapshot()
    if on_done is not None:
        on_done(trainers[0].model, p.dataset)
    return summary


def _gather(futures: list[Any]) -> list[Any]:
    errors = [f.exception() for f in futures]
    causes = [e for e in errors if e is not None and not isinstance(e, CollectiveError)]
    first = causes or [e for e in errors if e is not None]
    if first:
        raise first[0]
    return [f.result() for f in futures]


def summarise(
    spec: JobSpec, p: Plan, results: list[AgentResult], models: list[Any],
    channels: list[PeerChannel], wall: float,
) -> dict[str, Any]:  # fmt: skip
    """The `--json` object: accuracy, rounds, bytes, hashes, and per-round rows."""
    evals = [r.evals for r in results]
    final = [e[-1]["accuracy"] for e in evals if e]
    hashes = sorted({params_sha256(m) for m in models})
    sent = [ch.endpoint.stats.bytes_sent for ch in channels]
    numel = param_count(models[0])
    rows = [_mean_row([res.rows[i] for res in results]) for i in range(results[0].rounds_run)]
    return {
        "final_accuracy": sum(final) / len(final) if final else 0.0,
        "rounds": results[0].rounds_run,
        "bytes_sent_per_agent": sum(sent) / len(sent),
        "frames_sent_per_agent": sum(ch.endpoint.stats.frames_sent for ch in channels) / len(sent),
        "dense_equivalent_bytes": _dense_equivalent(spec, numel, results[0].rounds_run),
        "wall_seconds": wall,
        "params": numel,
        "layout": "star" if spec.topology == "star" else layout_name(spec.topology, spec.agents),
        "model_hashes": hashes,
        "identical_models": len(hashes) == 1,
        "rollbacks": results[0].rollbacks,
        "evals": evals[0],
        "rows": rows,
        "round_seconds": _mean_times(rows),
        "manifest": p.manifest.to_dict(),
        "model_sha256_initial": p.model_sha256,
    }


def _dense_equivalent(spec: JobSpec, numel: int, rounds: int) -> float:
    """Bytes per agent a dense fp32 ring would send for the same rounds (payload only)."""
    n = spec.agents
    return 2 * (n - 1) / n * numel * 4 * rounds if n > 1 else 0.0


def _mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for key in ("loss", "grad_norm", "compression_error", "residual_norm", "bytes_sent", *TIMES):
        if key in out:
            out[key] = sum(r[key] for r in rows) / len(rows)
    return out


def _mean_times(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per round of compute, communication and the whole step (sync mode)."""
    timed = [r for r in rows if "step_s" in r]
    return {k: sum(r[k] for r in timed) / len(timed) for k in TIMES} if timed else {}

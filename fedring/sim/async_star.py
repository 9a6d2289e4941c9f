"""Asynchronous training through a star (SEEDS B): stale updates, weighted down.

The aggregator holds the global model and its version. An agent pulls the model,
runs H local steps, and pushes its compressed delta (with error feedback). The
aggregator weights each delta by ``1 / (1 + staleness) ** power``, where
staleness is how many versions were applied since that agent pulled, and applies
them once `async_wait` have arrived (soft synchronisation: 1 is plain async, N is
synchronous). The agent then pulls the new version and starts again.

Time is simulated: an agent with speed factor 3 (``slow = "3:0"``) takes three
times as long for its H steps, so the order of arrivals is exactly what a slow
board would cause, and the run is deterministic. Every update and every model
still travels as real frames through the in-process transport.

The agents train with one intra-op torch thread, as an agent daemon does (the
generic profile's ``torch_threads = 1``) and as the sync runner does: local steps
on two threads round some sums differently, and with one agent over MQTT the job
then left `simulate`'s hash after about 100 versions (fp16 deltas hide the last
bits until error feedback carries one across a rounding boundary).
"""

from __future__ import annotations

import copy
import heapq
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedring import build
from fedring.aggregation.rules import Aggregation, robust
from fedring.collective.channel import PeerChannel
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.compression.payload import PayloadLimits
from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.engine.async_reply import AsyncBase, AsyncReplies
from fedring.engine.group import LOCAL_KEY
from fedring.engine.local import LocalWork
from fedring.engine.plan import Plan
from fedring.engine.reducer import compress_update
from fedring.engine.sampler import ShardSampler
from fedring.training.models import param_count, params_sha256, set_flat_params
from fedring.transport.base import Deadline
from fedring.transport.inproc import InprocTransport

CENTRE = "aggregator"


def simulate_async(
    spec: JobSpec,
    p: Any,
    on_round: Callable[[int, dict[str, Any]], None] | None,
    on_done: Callable[[torch.nn.Module, Any], None] | None = None,
) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as an agent daemon trains: the same bits (module docstring)
    try:
        return _simulate(spec, p, on_round, on_done)
    finally:
        torch.set_num_threads(threads)


def _simulate(
    spec: JobSpec,
    p: Any,
    on_round: Callable[[int, dict[str, Any]], None] | None,
    on_done: Callable[[torch.nn.Module, Any], None] | None,
) -> dict[str, Any]:
    start = time.perf_counter()
    trainers = [_agent(spec, p, *build.prepare_model(spec, p, r), r) for r in range(spec.agents)]
    hub, counters = InprocTransport(), Counters()
    centre = PeerChannel(hub.connect(CENTRE), "sim", key=LOCAL_KEY, counters=counters)
    agents = [
        PeerChannel(hub.connect(f"agent-{i}"), "sim", key=LOCAL_KEY, counters=counters)
        for i in range(spec.agents)
    ]
    numel = param_count(trainers[0].model)
    limits = PayloadLimits(max_numel=numel)
    compressed = spec.compression == "group-topk"
    topk = GroupTopK(spec.group_size, spec.k, spec.value_dtype) if compressed else None  # type: ignore[arg-type]
    efs = [ErrorFeedback(numel) if compressed and spec.error_feedback else None for _ in trainers]
    agg = Aggregation.parse(spec.aggregation)
    model = trainers[0].params
    # The centre evaluates on a model of its own, as the MQTT coordinator does: an
    # agent's model is the base it pulled, and setting it would change its next steps.
    central = copy.deepcopy(trainers[0].model)
    version, pulled = 0, [0] * spec.agents
    replies = AsyncReplies(model, version, counters=counters)
    bases = [AsyncBase(counters) for _ in trainers]
    pace = build.speeds(spec)
    events = [(spec.local_steps * pace[r], r) for r in range(spec.agents)]
    heapq.heapify(events)
    buffer: list[tuple[torch.Tensor, float]] = []
    evals: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    now = 0.0

    while version < spec.rounds:
        now, rank = heapq.heappop(events)
        trainer = trainers[rank]
        anchor = trainer.params
        losses = trainer.steps(spec.local_steps, spec.lr)
        deadline = Deadline.after(spec.timeout_s)
        agents[rank].send(
            CENTRE,
            compress_update(trainer.params - anchor, topk, efs[rank])[0],
            round=version,
            step=rank,
            phase="up",
            deadline=deadline,
        )
        delta = centre.recv(
            f"agent-{rank}", round=version, step=rank, phase="up", deadline=deadline, limits=limits
        )
        staleness = version - pulled[rank]
        buffer.append((delta.decompress(), 1.0 / (1.0 + staleness) ** spec.staleness_power))
        if len(buffer) >= spec.async_wait:
            stacked = torch.stack([d * w for d, w in buffer])
            update = robust(stacked, agg) if agg.robust else stacked.mean(dim=0)
            old, model = model, model + update
            version += 1
            replies.applied(old, model, version)
            buffer.clear()
            rows.append(
                {
                    "round": version,
                    "loss": sum(losses) / len(losses),
                    "staleness": staleness,
                    "sim_time": now,
                    "bytes_sent": agents[rank].endpoint.stats.bytes_sent,
                }
            )
            if version % spec.eval_every == 0 or version == spec.rounds:
                set_flat_params(central, model)
                test_loss, acc = p.task.evaluate(central, p.dataset)
                evals.append(
                    {"round": version, "test_loss": test_loss, "accuracy": acc, "sim_time": now}
                )
                rows[-1].update(evals[-1])
            if on_round is not None:
                on_round(version - 1, rows[-1])
        # the agent pulls the current model (a real frame: a patch against the one it
        # last pulled where smaller, `engine.async_reply`) and starts its next H steps
        for whole in (False, True):  # a patch the agent refuses: the model whole
            centre.send(f"agent-{rank}", replies.reply(f"agent-{rank}", model, version,
                                                       dense=whole),
                        round=version, step=rank, phase="down", deadline=deadline)  # fmt: skip
            fresh = agents[rank].recv(
                CENTRE, round=version, step=rank, phase="down", deadline=deadline, limits=limits
            )
            params = bases[rank].take(fresh)
            if params is not None:
                break
        assert params is not None  # a whole model is always taken
        trainer.set_params(params)
        pulled[rank] = version
        heapq.heappush(events, (now + spec.local_steps * pace[rank], rank))
    for ch in agents:
        ch.endpoint.close()
    sent = [ch.endpoint.stats.bytes_sent for ch in agents]
    set_flat_params(central, model)
    if on_done is not None:
        on_done(central, p.dataset)
    return {
        "final_accuracy": evals[-1]["accuracy"] if evals else 0.0,
        "rounds": version,
        "bytes_sent_per_agent": sum(sent) / len(sent),
        "bytes_received_per_agent": sum(ch.endpoint.stats.bytes_received for ch in agents)
        / len(agents),
        "dense_equivalent_bytes": float(numel * 4 * version * spec.async_wait / spec.agents),
        "wall_seconds": time.perf_counter() - start,
        "sim_seconds_units": now,
        "params": numel,
        "model_hashes": [params_sha256(central)],
        "identical_models": True,
        "rollbacks": 0,
        "evals": evals,
        "rows": rows,
        "manifest": p.manifest.to_dict(),
        "model_sha256_initial": p.model_sha256,
        "counters": counters.snapshot(),
    }


def _agent(spec: JobSpec, p: Plan, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
           rank: int) -> LocalWork:  # fmt: skip
    """One asynchronous agent: its model, its optimizer (momentum SGD) and seeded batches."""
    return LocalWork(
        model, x, y, p.task.loss,
        ShardSampler(len(x), batch_size=spec.batch_size, seed=spec.seed, rank=rank),
        build.optimizer(spec, p.task, model),
    )  # fmt: skip

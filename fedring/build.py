"""From a `JobSpec` to the engine's objects: the one place runners turn a job into
typed settings for each layer (nothing below the runners sees the whole spec).

`member` builds what one agent trains with: the job's task, its optimizer (the
task's own, or a plain `torch.optim.SGD`), the reducer, the distributed
optimizer, the scaled and warmed-up learning rate, and a seeded sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedring.aggregation.rules import Aggregation
from fedring.config import AUTO_LR, JobSpec, SpecError
from fedring.counters import Counters
from fedring.engine.attack import Attack, AttackingReducer
from fedring.engine.centre import AsyncSettings, CentreSettings
from fedring.engine.gate import Gate, Resolved
from fedring.engine.group import Collective, Group
from fedring.engine.loop import LoopSettings, Member
from fedring.engine.lr import LinearScaling
from fedring.engine.optimizer import DistributedOptimizer, SyncSettings
from fedring.engine.overlap import Yielder
from fedring.engine.participation import per_round
from fedring.engine.plan import Plan, prepare
from fedring.engine.plan import plan as plan_task
from fedring.engine.reducer import Reducer, ReducerSettings
from fedring.engine.resync import ResyncSettings, resync_every
from fedring.engine.sampler import ShardSampler
from fedring.engine.state import TrainerState
from fedring.engine.task import Task
from fedring.training.datasets import Dataset
from fedring.training.lr import LrSchedule


def resolve(
    spec: JobSpec, data_dir: Path | None = None, allowed_modules: Iterable[str] | None = None
) -> Resolved:
    """The job's task (the user's `spec.task`, or the built-in dataset + model) and the
    modules it was loaded from, through the gate (`engine.gate`).

    `allowed_modules` is an agent's own list: a ``MODULE:ATTR`` task or a
    ``MODULE:FACTORY`` model loads only if MODULE is in it, and an ``npz:`` path only
    if it lies under `data_dir`. `None` means the spec is this process's own
    configuration (the coordinator's job file, `fedring simulate`'s flags): any module,
    any path.
    """
    gate = Gate.own(data_dir) if allowed_modules is None else Gate.agent(allowed_modules,
                                                                          data_dir)  # fmt: skip
    return gate.job(spec.task, spec.dataset, spec.model)


def task_of(
    spec: JobSpec, data_dir: Path | None = None, allowed_modules: Iterable[str] | None = None
) -> Task:
    """The job's task, as `resolve` loads it."""
    return resolve(spec, data_dir, allowed_modules).task


def plan(spec: JobSpec) -> Plan:
    """The coordinator's part for the job: shards, manifest, initial model."""
    weighted = Aggregation.parse(spec.aggregation).kind == "weighted"
    job = resolve(spec)
    return plan_task(
        job.task, agents=spec.agents, sharding=spec.sharding, seed=spec.seed,
        weight_cap=spec.weight_cap if weighted else None, sources=job.sources,
    )  # fmt: skip


def reducer_settings(spec: JobSpec) -> ReducerSettings:
    return ReducerSettings(
        compression=spec.compression,  # type: ignore[arg-type]
        density=float(spec.density),
        group_size=spec.group_size,
        value_dtype=spec.value_dtype,  # type: ignore[arg-type]
        error_feedback=spec.error_feedback,
        momentum_correction=spec.momentum if spec.compressed_sync and spec.momentum_correction
        else 0.0,
        density_warmup=spec.density_warmup,
        density_flush=spec.density_flush,
        rounds=spec.rounds,
        policy=spec.policy,  # type: ignore[arg-type]
        sign_feedback=Aggregation.parse(spec.aggregation).kind == "vote",
        timeout_s=spec.timeout_s,
        consensus=consensus(spec),
    )


def consensus(spec: JobSpec) -> bool:
    """A robust rule over group-top-k, synchronously through a star: the members send
    their values on the centre's consensus support (`compression.support`)."""
    rule = Aggregation.parse(spec.aggregation)
    return rule.robust and spec.compression == "group-topk" and spec.sync != "async"


def needs_centre(spec: JobSpec) -> bool:
    """Updates go through a centre: a star job, a robust rule, or asynchronous training."""
    rule = Aggregation.parse(spec.aggregation)
    return spec.topology == "star" or rule.needs_star or spec.sync == "async"


def degrades(spec: JobSpec) -> bool:
    """A ring job that may go on asynchronously through the coordinator (`degrade_after`)."""
    return spec.degrade_after > 0 and not needs_centre(spec)


def opens_centre(spec: JobSpec) -> bool:
    """Over MQTT: the job's agents and coordinator open the star topic's endpoint."""
    return needs_centre(spec) or degrades(spec)


def async_settings(spec: JobSpec, start_version: int = 0) -> AsyncSettings:
    return AsyncSettings(
        rounds=spec.rounds, start_version=start_version, wait=spec.async_wait,
        staleness_power=spec.staleness_power, aggregation=spec.aggregation,
        timeout_s=spec.timeout_s,
    )  # fmt: skip


def speeds(spec: JobSpec) -> list[float]:
    """Per-agent time factors from ``slow = "F:RANK[,F:RANK...]"`` (default 1)."""
    out = [1.0] * spec.agents
    for item in filter(None, spec.slow.split(",")):
        try:
            factor, rank = item.split(":")
            out[int(rank)] = float(factor)
        except (ValueError, IndexError):
            raise SpecError(
                f"field 'slow'={spec.slow!r}: expected FACTOR:RANK with RANK < agents"
            ) from None
    return out


def centre_settings(spec: JobSpec, start_round: int = 0) -> CentreSettings:
    return CentreSettings(
        aggregation=spec.aggregation, rounds=spec.rounds, start_round=start_round,
        timeout_s=spec.timeout_s, sample=spec.sample, seed=spec.seed,
        consensus=consensus(spec), group_size=spec.group_size,
    )  # fmt: skip


def sync_settings(spec: JobSpec) -> SyncSettings:
    return SyncSettings(
        mode="sync" if spec.sync == "sync" else "local",
        local_steps=spec.local_steps,
        aggregation=spec.aggregation,
        rounds=spec.rounds,
        correction=spec.correction if spec.sync == "adaptive" else 0.0,
        reset_state_at_sync=True,  # each round's local steps start afresh from the global model
        update_delay=spec.update_delay,
        bucket_kb=spec.bucket_kb,
        star=spec.topology == "star",
        sample=spec.sample,
        seed=spec.seed,
        sit_out=spec.sit_out,
        # a job's members agree on what Flower's relayed ring and node send: the
        # gradient (a task's own Adam too), as before `SyncSettings.agree` existed
        agree="gradient" if spec.sync == "sync" else "auto",
    )


def loop_settings(spec: JobSpec, *, mixed: bool = False) -> LoopSettings:
    """The round loop's settings; `mixed`: the members run on more than one CPU
    architecture (re-sync under ``resync = "mixed"``)."""
    return LoopSettings(
        rounds=spec.rounds, eval_every=spec.eval_every, target=spec.target_accuracy,
        adaptive=spec.sync == "adaptive",
        stop_at_target=Aggregation.parse(spec.aggregation).kind != "hybrid",
        resync=ResyncSettings(resync_every(spec.resync, spec.resync_every, mixed)),
    )  # fmt: skip


def trained_per_round(spec: JobSpec) -> int:
    """Agents whose updates a round averages: all, or the sample (the rate scales by it)."""
    return per_round(spec.agents, spec.sample)


def lr_schedule(spec: JobSpec) -> LrSchedule:
    """The job's learning rate per round (for runners that step by hand)."""
    agg = Aggregation.parse(spec.aggregation)
    return LrSchedule(
        base_lr=spec.lr, scaling=spec.lr_scaling, n_agents=trained_per_round(spec),
        batch_size=spec.batch_size, ref_batch=spec.ref_batch, warmup_steps=spec.warmup_steps,
        # Goyal et al.'s rule is for averaged gradients of one large batch: sync mode.
        averaged=agg.averaged and spec.sync == "sync",
    )  # fmt: skip


def scaling(spec: JobSpec, inner: torch.optim.Optimizer) -> LinearScaling:
    """Linear scaling with warm-up, applied only where updates are averaged (sync)."""
    averaged = Aggregation.parse(spec.aggregation).averaged and spec.sync == "sync"
    return LinearScaling(
        inner, world=trained_per_round(spec), batch_size=spec.batch_size,
        ref_batch=spec.ref_batch,
        warmup_steps=spec.warmup_steps, scaling=spec.lr_scaling, averaged=averaged,
    )  # fmt: skip


def optimizer(spec: JobSpec, task: Task, model: nn.Module) -> torch.optim.Optimizer:
    """The task's own optimizer if it has one (`task.optimizer(model, lr)`), else SGD:
    no momentum for compressed gradients every step (plain EF-SGD, or DGC momentum
    inside error feedback), the job's momentum otherwise."""
    own = getattr(task, "optimizer", None)
    if own is not None:
        opt = own(model, spec.lr)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"task {task.name!r}: optimizer() returned {type(opt).__name__}")
        return opt
    momentum = 0.0 if spec.compressed_sync else spec.momentum
    return torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=momentum)


def dense_plan_rates(spec: JobSpec, task: Task) -> tuple[float, float] | None:
    """(lr, momentum) the dense plans of ``compression = "auto"`` train with: those a
    ``compression = "none"`` job gets (momentum SGD at the automatic `AUTO_LR`), where
    the job's own are plain EF-SGD's automatic ones. None where the rates stay: a rate
    the user set, DGC momentum correction, the task's own optimizer.

    `choose.ROUNDS_AT_FLOOR` is group-top-k's rounds over the dense job's, each with its
    own rates; a dense plan on EF-SGD's rates (lr 0.1, no momentum) needs nearly
    group-top-k's rounds (MNIST-1D CNN to 0.85: 410 against 470 and 230; digits MLP to
    0.95: 70 against 95 and 55, `docs/concepts/collectives.md`), so choosing it would
    buy a shorter round and none of the rounds the choice was weighed on."""
    if getattr(task, "optimizer", None) is not None:
        return None
    if not (spec.compression_auto and spec.lr_auto and spec.plain_ef_sgd):
        return None
    return AUTO_LR, spec.momentum


def retune(member: Member, spec: JobSpec, task: Task, dense: bool) -> None:
    """Give `member`'s optimizer the rates of its epoch's codec (`dense_plan_rates`):
    each group's base rate and momentum, its momentum buffers dropped on a change (the
    warm-up and the monitor's halvings go on)."""
    rates = dense_plan_rates(spec, task)
    if rates is None:
        return
    lr, momentum = rates if dense else (spec.lr, 0.0)
    inner = member.state.optimizer.optimizer
    groups = inner.param_groups
    if all(g.get("initial_lr") == lr and g["momentum"] == momentum for g in groups):
        return
    for g in groups:
        g["initial_lr"], g["lr"], g["momentum"] = lr, lr, momentum
    inner.state.clear()  # SGD's only state: the momentum buffers
    factor = member.scaling.factor
    member.scaling = scaling(spec, inner)
    member.scaling.factor = factor


def member(
    spec: JobSpec, task: Task, dataset: Dataset, model: nn.Module, x: torch.Tensor,
    y: torch.Tensor, collective: Collective | Group, *, rank: int, weight: float,
    yielder: Yielder | None = None, start_round: int = 0,
    on_round: Callable[[int, dict[str, Any]], None] | None = None,
    before_round: Callable[[int], None] | None = None,
    attack: Attack | None = None, counters: Counters | None = None,
) -> Member:  # fmt: skip
    """One agent's `Member` for the job (see the module docstring).

    `attack` (a test harness, `engine.attack`; None for every honest member): this
    member poisons what it sends, or trains on flipped labels; `counters` counts
    its poisoned updates."""
    centre = collective.centre if isinstance(collective, Group) else None
    if isinstance(collective, Group):
        collective = collective.collective
    inner = optimizer(spec, task, model)
    numel = sum(p.numel() for p in model.parameters())
    if attack is None:
        reducer = Reducer(collective, numel, reducer_settings(spec), centre=centre)
    else:
        y = attack.labels(y, dataset.num_classes)
        reducer = AttackingReducer(collective, numel, reducer_settings(spec), centre=centre,
                                   attack=attack, seed=spec.seed * 1_000 + rank,
                                   counters=counters)  # fmt: skip
    opt = DistributedOptimizer(inner, reducer, sync_settings(spec), model=model, weight=weight,
                               yielder=yielder, initial="trust")  # start hash-checked: prepare
    sampler = ShardSampler(len(x), batch_size=spec.batch_size, seed=spec.seed, rank=rank)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(sampler.next_batch())
        return x[idx], y[idx]

    return Member(
        TrainerState(model, opt, sampler), next_batch, task.loss,
        lambda m: task.evaluate(m, dataset), scaling(spec, inner), on_round, before_round,
        start_round,
    )  # fmt: skip


def prepare_model(spec: JobSpec, p: Plan, rank: int) -> tuple[Any, Any, Any]:
    """What an agent does before training: verify its shard, take the initial model."""
    return prepare(
        p.task, p.dataset, p.manifest, p.shards[rank], rank, seed=spec.seed,
        model_sha256=p.model_sha256, initial=p.initial if spec.init == "sent" else None,
    )  # fmt: skip

"""An S x D grid: D replicas of each of S stages train one model together.

Worker (s, d) runs stage s of replica d. Micro-batches of replica d's batch flow
through its stages (`Stage.run`, in the schedule's order); then the D replicas of
each stage all-reduce that stage's gradient in their own ring with the engine's
`Reducer` (group-top-k + error feedback, or dense), and every worker steps its
optimizer. All replicas of a stage therefore keep identical parameters, and the
grid trains the model that data parallelism over D agents with batch B each would.

Every worker has one `PeerChannel` (one endpoint): its pipeline frames (phases
``pp-act``, ``pp-grad``) and its stage ring's frames share it, told apart by
their position, so one thread serves both without a second inbox.

    grid = build_grid(layers, plan, 2, settings, loss_fn=F.cross_entropy, ...)
    run_steps(grid, start=0, steps=100, lr_at=lambda step: 0.1)
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.counters import Counters
from fedring.engine.group import LOCAL_KEY, Group
from fedring.engine.reducer import Reducer, ReducerSettings
from fedring.engine.sampler import ShardSampler
from fedring.pipeline.partition import StagePlan
from fedring.pipeline.schedule import Op, ops
from fedring.pipeline.stage import LossFn, Stage, WireSettings
from fedring.training.models import flat_grads, param_count, set_flat_grads
from fedring.transport.base import Endpoint
from fedring.transport.inproc import InprocTransport

Batch = Callable[[], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ShardBatches:
    """A replica's batches from its shard; every stage of the replica draws the same
    (seeded) ones, and its sampler's state goes into the stage's checkpoint."""

    x: torch.Tensor
    y: torch.Tensor
    sampler: ShardSampler

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(self.sampler.next_batch())
        return self.x[idx], self.y[idx]


@dataclass(frozen=True)
class PipelineSettings:
    """How the grid runs a step."""

    micro_batches: int = 4  # M: each replica's batch is cut into M micro-batches
    schedule: str = "1f1b"  # gpipe | 1f1b
    wire: WireSettings = field(default_factory=WireSettings)
    topology: str = "auto"  # each stage's replica ring: auto | ring | torus


def worker_name(stage: int, replica: int) -> str:
    return f"stage{stage}-r{replica}"


@dataclass
class GridWorker:
    """Stage `stage.index` of replica `replica`: its step, reduction and update."""

    stage: Stage
    replica: int
    replicas: int
    ops: tuple[Op, ...]
    next_batch: Batch  # replica `replica`'s batches, the same on each of its stages
    optimizer: torch.optim.Optimizer | None  # None: a stage without parameters
    reducer: Reducer | None  # None: one replica, or nothing to reduce
    micro_batches: int
    losses: list[float] = field(default_factory=list)  # last stage: the batch loss per step
    bytes_after: list[int] = field(default_factory=list)  # bytes this endpoint sent, per step
    reduce_s: float = 0.0  # CPU seconds of this thread in the stage ring (waits excluded)

    def train_step(self, step: int, lr: float) -> None:
        x, y = self.next_batch()
        if len(x) < self.micro_batches:
            raise ValueError(f"a batch of {len(x)} rows cannot make "
                             f"{self.micro_batches} micro-batches")  # fmt: skip
        xs = torch.tensor_split(x, self.micro_batches)
        ys = torch.tensor_split(y, self.micro_batches)
        rows = [len(c) for c in xs]
        stage = self.stage
        stage.module.train()  # an evaluation of the assembled model left it in eval mode
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        losses = stage.run(step, self.ops, rows, xs if stage.first else None,
                           ys if stage.last else None)  # fmt: skip
        if stage.last:
            self.losses.append(sum(v * r for v, r in zip(losses, rows, strict=True)) / len(x))
        if self.reducer is not None:
            start = time.thread_time()  # CPU only: compression, frames, sums; no waits
            total = self.reducer.allreduce(flat_grads(stage.module), scale=1.0 / self.replicas,
                                           round=step)  # fmt: skip
            set_flat_grads(stage.module, total)
            self.reduce_s += time.thread_time() - start
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.bytes_after.append(stage.channel.endpoint.stats.bytes_sent)


def build_worker(
    module: nn.Module, plan: StagePlan, stage: int, replica: int, replicas: int,
    settings: PipelineSettings, channel: PeerChannel, *, loss_fn: LossFn,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    reducer_settings: ReducerSettings, next_batch: Batch,
    names: Callable[[int, int], str] = worker_name,
) -> GridWorker:  # fmt: skip
    """Worker (`stage`, `replica`) of the grid, training `module` (that stage's layers,
    its own copy) over `channel`: what one board, or one process, holds. `names(s, d)`
    is the endpoint of worker (s, d) (an agent's id where daemons hold the stages)."""
    count = len(plan.stages)
    spec = plan.stages[stage]
    s, d = stage, replica
    own = Stage(s, count, module, channel, names(s - 1, d) if s else None,
                names(s + 1, d) if s < count - 1 else None, spec.in_shape,
                loss_fn if s == count - 1 else None, settings.wire)  # fmt: skip
    numel = param_count(module)
    reducer = None
    if replicas > 1 and numel:
        members = tuple(names(s, r) for r in range(replicas))
        ring = Group(channel, members, settings.topology, settings.wire.timeout_s)
        reducer = Reducer(ring.collective, numel, reducer_settings)
    return GridWorker(
        own, d, replicas,
        ops(settings.schedule, stages=count, micro_batches=settings.micro_batches, stage=s),
        next_batch, make_optimizer(module) if numel else None, reducer, settings.micro_batches,
    )  # fmt: skip


def build_grid(
    layers: Sequence[nn.Module], plan: StagePlan, replicas: int, settings: PipelineSettings, *,
    loss_fn: LossFn, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    reducer_settings: ReducerSettings, data: Callable[[int], Batch],
    hub: InprocTransport | None = None, counters: Counters | None = None, job: str = "pipeline",
    connect: Callable[[str], Endpoint] | None = None,
) -> list[list[GridWorker]]:  # fmt: skip
    """Workers ``[stage][replica]``, each stage's replicas starting from the same copy
    of its `layers`; `data(d)` gives replica d's batches (called once per worker).

    Each worker's endpoint is ``connect(worker_name(s, d))``: by default one on `hub`
    (in-process); an MQTT link's endpoint carries the same frames through a broker."""
    if connect is None:
        connect = (hub or InprocTransport()).connect
    counters = counters or Counters()
    count = len(plan.stages)
    channels = [[PeerChannel(connect(worker_name(s, d)), job, key=LOCAL_KEY,
                             counters=counters) for d in range(replicas)]
                for s in range(count)]  # fmt: skip
    grid = []
    for spec in plan.stages:
        s = spec.index
        module = nn.Sequential(*layers[spec.start : spec.end])
        grid.append([
            build_worker(copy.deepcopy(module), plan, s, d, replicas, settings, channels[s][d],
                         loss_fn=loss_fn, make_optimizer=make_optimizer,
                         reducer_settings=reducer_settings, next_batch=data(d))
            for d in range(replicas)
        ])  # fmt: skip
    return grid


def run_steps(
    grid: list[list[GridWorker]], *, start: int, steps: int, lr_at: Callable[[int], float],
    hub: InprocTransport | None = None,
) -> None:  # fmt: skip
    """Steps ``start .. start + steps - 1`` on every worker, one thread each (taking
    turns on `hub`'s baton when it has one). The first failure is raised; a failed
    worker closes its endpoint so that its neighbours fail fast instead of waiting."""
    workers = [w for row in grid for w in row]
    baton = hub.baton if hub is not None else None

    def work(w: GridWorker) -> None:
        try:
            with baton.turn() if baton else contextlib.nullcontext():
                for step in range(start, start + steps):
                    w.train_step(step, lr_at(step))
        except BaseException:
            w.stage.channel.endpoint.close()
            raise

    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        futures = [pool.submit(work, w) for w in workers]
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    causes = [e for e in errors if not isinstance(e, CollectiveError)] or errors
    if causes:
        raise causes[0]


def assembled(grid: list[list[GridWorker]], replica: int = 0) -> nn.Sequential:
    """Replica `replica`'s stages as one model (shares their parameters)."""
    return nn.Sequential(*[m for row in grid for m in row[replica].stage.module.children()])

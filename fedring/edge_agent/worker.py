"""One agent's part of a job: its verified shard, its model, and runs of rounds.

A job runs in *segments*: the coordinator's manifest names the members in ring
order, the epoch, and the round to start from. A lost peer, a returning one, or
a restarted coordinator ends a segment; the next one starts from the round the
coordinator has a checkpoint of. The worker keeps its full state (parameters,
velocity, error-feedback residual, batch order) at the start of the last few
rounds, so when it holds that round it continues exactly as if nothing had
happened; otherwise it loads the checkpoint's parameters, checked by sha256.

The rounds themselves are the engine's loop (`engine.loop.run`), the same code as
`fedring simulate`, over a `PeerChannel` on the MQTT endpoint.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedring import build
from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.compression.payload import Payload
from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.engine.attack import COUNTER as ATTACK_COUNTER
from fedring.engine.attack import Attack
from fedring.engine.centre import Centre, run_async_member
from fedring.engine.gate import CodeRefused
from fedring.engine.group import Group
from fedring.engine.local import LocalWork
from fedring.engine.loop import Member, run
from fedring.engine.plan import ModelMismatch, prepare
from fedring.engine.reducer import compress_update
from fedring.engine.resync import nudge
from fedring.engine.sampler import ShardSampler
from fedring.engine.task import Task, TaskError, check_task
from fedring.firmware_profiles.apply import check_budget, dataset_bytes, estimate_memory
from fedring.firmware_profiles.schema import Profile
from fedring.training.datasets import Dataset
from fedring.training.models import (
    flat_params,
    flat_sha256,
    param_count,
    params_sha256,
    set_flat_params,
)
from fedring.training.sharding import (
    ShardEntry,
    make_shards,
    shard_data,
    verify_shard,
)
from fedring.transport import topics
from fedring.transport.base import Endpoint
from fedring.wire.frame import FrameLimits

log = logging.getLogger(__name__)

KEEP_SNAPSHOTS = 4


class JobRefused(ValueError):
    """The manifest asks for something this agent cannot verify or hold."""


class Halted(CollectiveError):
    """The coordinator halted the segment at a round boundary."""


@dataclass
class Segment:
    """One manifest: who is in the ring, from which round, under which epoch."""

    job: str
    epoch: int
    members: list[str]  # in ring order; only the names it exchanges with, ~i elsewhere
    start_round: int
    params_sha256: str  # expected state at start_round
    head: str  # waits for each checkpoint's ack; uploads whole where due (checkpoint_stream)
    max_frame_bytes: int = 0  # the ring's frame size (the smallest member's); 0: the default
    asynchronous: bool = False  # through the coordinator: an async job, or a degraded ring
    weight: float = 0.0  # this member's share of the mean; 0: 1 / members
    mixed: bool = False  # the members run on more than one CPU architecture (re-sync)
    collective: str = ""  # ring | fanout | hub: what the coordinator planned; "": the job's
    codec: str = ""  # "dense": compression "auto" chose dense fp32 here; "": the job's
    # every member holds the state at start_round (a re-plan): it goes on with all of it;
    # else the start is a checkpoint's, its parameters only (`JobWorker.restore`)
    held: bool = False
    timeout_s: float = 0.0  # each step's deadline where the job's is too short; 0: the job's
    barrier: bool = False  # round 0 waits for the coordinator's go (a broadcast collective)

    @property
    def channel_job(self) -> str:
        return f"{self.job}.e{self.epoch}"


def segment_collective(seg: Segment, spec: JobSpec) -> str:
    """The segment's planned collective; a job's ``auto`` never planned runs the ring."""
    chosen = seg.collective or spec.collective
    return "ring" if chosen == "auto" else chosen


class JobWorker:
    """The agent's state for one job, kept across segments."""

    def __init__(
        self, me: str, job: str, spec: JobSpec, shard: int, manifest: dict[str, Any],
        model_sha256: str, data_dir: Path | None = None, budget: Profile | None = None, *,
        task: dict[str, Any] | None = None, allowed_modules: tuple[str, ...] = (),
        runtime: Callable[[], int] | None = None,  # resident bytes now (0 / None: assumed)
    ) -> None:  # fmt: skip
        self.me, self.job, self.spec, self.shard = me, job, spec, shard
        try:  # only code installed here or allowed, only files under data_dir (the gate)
            loaded = build.resolve(spec, data_dir, allowed_modules)
            self.task = loaded.task
            if task is not None:  # name, version and source sha256 as the coordinator's
                if not isinstance(task, dict):
                    raise TaskError(f"manifest field 'task' must be a table, got {task!r}")
                check_task(self.task, task, loaded.sources)
        except CodeRefused:
            raise  # as it is: the daemon counts these apart
        except TaskError as exc:
            raise JobRefused(str(exc)) from None
        dataset = self.task.dataset(spec.seed)
        entry = ShardEntry.from_dict(manifest)  # ShardError: the daemon refuses the job
        if entry.n_agents != spec.agents or entry.rank != shard:
            raise JobRefused(f"shard entry {entry.rank} of {entry.n_agents}, job: shard "
                             f"{shard} of {spec.agents}")  # fmt: skip
        index = make_shards(dataset.y_train.numpy(), spec.agents, spec.sharding, spec.seed)[shard]
        if spec.init == "derived":
            try:
                model, x, y = prepare(
                    self.task, dataset, entry, index, shard, seed=spec.seed,
                    model_sha256=model_sha256, initial=None,
                )  # fmt: skip
            except ModelMismatch as exc:
                raise JobRefused(str(exc)) from None
        else:
            model, x, y = _shard_and_model(self.task, dataset, entry, index, shard,
                                           spec.seed)  # fmt: skip
        if budget is not None:  # refuse before training, with the estimate and the budget
            data = dataset_bytes(dataset)
            # Measured now: the interpreter, torch, the dataset's packages and the data.
            used = runtime() if runtime is not None else 0
            check_budget(budget, estimate_memory(spec, model, dataset.feature_shape, data,
                                                 used))  # fmt: skip
        self.model, self.x, self.y, self.dataset = model, x, y, dataset
        self.numel = param_count(model)
        self._param_names = [name for name, _ in model.named_parameters()]
        self.member: Member | None = None
        self.states: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.committed = 0  # rounds completed in the current state
        # an async job's local work and its deltas' compressor (with error feedback)
        self._async: tuple[LocalWork, Callable[[torch.Tensor], Payload]] | None = None
        self.step_s = probe_step(model, x, y, min(spec.batch_size, len(x)))
        self.drift = 0.0  # tests: nudge the parameters by this much before each round
        self.attack: Attack | None = None  # tests: a robust rule's attacker (`engine.attack`)
        self.num_classes = dataset.num_classes
        # A derived start is held now; a sent one arrives as the round-0 "model".
        self.initial = flat_params(model) if spec.init == "derived" else None

    # -- state ------------------------------------------------------------------

    @property
    def params(self) -> torch.Tensor:
        return flat_params(self.model)

    def _keep(self, r: int) -> None:
        assert self.member is not None
        self.states[r] = self.member.state.snapshot()
        self.states.move_to_end(r)
        # The coordinator may restart the ring from any of the three newest checkpoint
        # rounds: the head runs one checkpoint ahead of the last saved one
        # (`running.Running.gate`), so the two newer uploads may not be saved yet.
        every = self.spec.checkpoint_every
        keep = sorted(k for k in self.states if k % every == 0)[-3:]
        while len(self.states) > KEEP_SNAPSHOTS:
            oldest = next(k for k in self.states if k not in keep)
            del self.states[oldest]

    def params_at(self, r: int) -> torch.Tensor | None:
        """The flat parameters at the start of round `r`: the model's own where that is
        where it stands, else a kept snapshot's; None where neither holds it."""
        if r == self.committed:
            return self.params
        return self._kept_params(r)

    def _kept_params(self, r: int) -> torch.Tensor | None:
        """The flat parameters of the snapshot kept for round `r` (None: not kept)."""
        st = self.states.get(r)
        if st is None:
            return None
        return torch.cat([st["model"][n].reshape(-1) for n in self._param_names])

    def state_sha256(self, r: int) -> str | None:
        if r == 0 and not self.states and self.initial is not None:
            return flat_sha256(self.initial)
        kept = self._kept_params(r)
        return None if kept is None else flat_sha256(kept)

    def restore(self, r: int, *, whole: bool = True) -> bool:
        """Return to the state at the start of round `r`, if still held. Not `whole`
        (a ring re-formed from a checkpoint, `Segment.held` false): its parameters only,
        as a member that lost the state loads them (`load`), so that momentum buffers and
        a delayed gradient do not part the members that kept theirs from one that did not."""
        if r == 0 and not self.states and self.initial is not None:
            self.committed = 0
            return True  # the derived start, untouched
        st = self.states.get(r)
        if st is None or self.member is None:
            return False
        self.member.state.restore(st)
        if not whole:
            self.member.state.load_params(self.params)
        self.committed = r
        return True

    def load(self, r: int, params: torch.Tensor) -> None:
        """Take the coordinator's parameters for round `r` (the initial model, or a
        checkpoint's): optimizer state and any delayed gradient start afresh."""
        if self.member is None:
            set_flat_params(self.model, params)
            self.initial = params.clone()
        else:
            self.member.state.load_params(params)
            self.states.clear()
            self._keep(r)
        self.committed = r

    # -- running ----------------------------------------------------------------

    def bind(self, group: Group, weight: float = 0.0, counters: Counters | None = None) -> Member:
        """Train with `group` from now on, with `weight` in the mean (0: 1 / members):
        build this agent's member on first use, or move the kept one onto the re-formed
        ring (its size changes weights and rate). `counters` counts an attacker's
        poisoned updates."""
        spec = self.spec.replace(agents=group.world)
        weight = weight or 1.0 / group.world
        if self.member is None:
            self.member = build.member(
                spec, self.task, self.dataset, self.model, self.x, self.y, group,
                rank=self.shard, weight=weight, attack=self.attack, counters=counters,
            )  # fmt: skip
            self._keep(self.committed)
            return self.member
        opt = self.member.state.optimizer
        opt.reducer.collective, opt.reducer.centre = group.collective, group.centre
        opt.weight = weight
        factor = self.member.scaling.factor  # keep the monitor's halvings
        self.member.scaling = build.scaling(spec, opt.optimizer)
        self.member.scaling.factor = factor
        return self.member

    def start_round(self, r: int, halt: threading.Event,
                    gate: Callable[[int], None] | None = None) -> None:  # fmt: skip
        """Before round `r`: the head's checkpoint `gate`, then the `halt`. Stopped by
        either, the state at the start of `r` is kept first, so that the nack names its
        sha256 and a re-plan resumes here (CI: the head, halted in its gate, kept none,
        and the ring went back to round 0)."""
        try:
            if gate is not None:
                gate(r)
            if halt.is_set():
                raise Halted(f"{self.me}: halted before round {r}")
        except CollectiveError:
            self._keep(r)
            raise
        if self.drift:  # a test's stand-in for another architecture's rounding
            nudge(self.model, self.drift, seed=r)
        self._keep(r)

    def run(
        self,
        seg: Segment,
        endpoint: Endpoint,
        key: bytes,
        counters: Counters,
        halt: threading.Event,
        on_round: Callable[[int, dict[str, Any]], None],
        gate: Callable[[int], None] | None = None,
        centre: Endpoint | None = None,
    ) -> dict[str, Any]:
        """Run rounds from `seg.start_round` to the end; raise `CollectiveError` if cut.

        A star job's updates go to the coordinator over `centre` (a private endpoint),
        an asynchronous segment's deltas too (`run_async`: an async job, or a ring
        the coordinator degraded)."""
        if seg.asynchronous:
            assert centre is not None, "an asynchronous segment runs through the coordinator"
            return self.run_async(seg, centre, key, counters, halt)
        spec = self.spec.replace(agents=len(seg.members))
        limits = FrameLimits(max_frame_bytes=seg.max_frame_bytes) if seg.max_frame_bytes else None
        channel = PeerChannel(endpoint, seg.channel_job, key=key, counters=counters,
                              limits=limits)  # fmt: skip
        hub = None
        if centre is not None:
            hub = Centre(PeerChannel(centre, seg.channel_job, key=key, counters=counters,
                                     limits=limits), topics.COORDINATOR)  # fmt: skip
        deadline = max(spec.timeout_s, seg.timeout_s)
        m = self.bind(Group(channel, tuple(seg.members), spec.topology, deadline, hub,
                            algorithm=segment_collective(seg, spec)), seg.weight,
                   counters)  # fmt: skip
        m.state.optimizer.reducer.dense = seg.codec == "dense"
        build.retune(m, spec, self.task, dense=seg.codec == "dense")  # the codec's own rates

        def before(r: int) -> None:
            self.start_round(r, halt, gate)

        def after(r: int, row: dict[str, Any]) -> None:
            self.committed = r + 1
            on_round(r, row)

        m.on_round, m.before_round, m.start_round = after, before, seg.start_round
        result = run(m, build.loop_settings(spec, mixed=seg.mixed))
        self._keep(self.committed)  # a halt in the head's last gate resumes from here
        last = result.evals[-1] if result.evals else {}
        return {
            "rounds": self.committed,
            "accuracy": last.get("accuracy", 0.0),
            "test_loss": last.get("test_loss", 0.0),
            "sha256": params_sha256(self.model),
            "rollbacks": result.rollbacks,
        }

    def run_async(
        self, seg: Segment, centre: Endpoint, key: bytes, counters: Counters,
        halt: threading.Event,
    ) -> dict[str, Any]:  # fmt: skip
        """Push deltas to the coordinator and take its model until it says the job ended."""
        spec = self.spec
        limits = FrameLimits(max_frame_bytes=seg.max_frame_bytes) if seg.max_frame_bytes else None
        channel = PeerChannel(centre, seg.channel_job, key=key, counters=counters, limits=limits)
        if self._async is None:  # kept across segments: the batch order and the residual go on
            sampler = ShardSampler(len(self.x), batch_size=spec.batch_size, seed=spec.seed,
                                   rank=self.shard)  # fmt: skip
            y = self.y if self.attack is None else self.attack.labels(self.y, self.num_classes)
            work = LocalWork(self.model, self.x, y, self.task.loss, sampler,
                             build.optimizer(spec, self.task, self.model))  # fmt: skip
            compressed = spec.compression == "group-topk"
            topk = GroupTopK(spec.group_size, spec.k, spec.value_dtype) if compressed else None  # type: ignore[arg-type]
            ef = ErrorFeedback(self.numel) if compressed and spec.error_feedback else None
            self._async = (work, self._async_compress(topk, ef, counters))
        work, compress = self._async

        def before(cycle: int) -> None:
            if halt.is_set():
                raise Halted(f"{self.me}: halted before cycle {cycle}")

        cycles = run_async_member(
            work, Centre(channel, topics.COORDINATOR), compress,
            steps=spec.local_steps, lr=spec.lr, timeout_s=spec.timeout_s,
            pace=build.speeds(spec)[self.shard], before=before,
        )  # fmt: skip
        test_loss, accuracy = self.task.evaluate(self.model, self.dataset)
        return {"rounds": cycles, "accuracy": accuracy, "test_loss": test_loss,
                "sha256": params_sha256(self.model), "rollbacks": 0}  # fmt: skip

    def _async_compress(
        self, topk: GroupTopK | None, ef: ErrorFeedback | None, counters: Counters
    ) -> Callable[[torch.Tensor], Payload]:
        """An async job's deltas compressed (with error feedback); an attacker's poisoned first."""
        attack, sent = self.attack, [0]
        if attack is None:
            return lambda delta: compress_update(delta, topk, ef)[0]

        def poisoned(delta: torch.Tensor) -> Payload:
            sent[0] += 1
            counters.add(ATTACK_COUNTER)
            seed = (self.spec.seed * 1_000 + self.shard) * 1_000_003 + sent[0]
            return compress_update(attack.update(delta, seed=seed), topk, ef)[0]

        return poisoned


def _shard_and_model(
    task: Task, dataset: Dataset, manifest: ShardEntry, index: Any, shard: int, seed: int
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The shard verified, the model built to be overwritten by the sent start."""
    x, y = shard_data(dataset, index)
    verify_shard(manifest, shard, x, y)
    return task.model(dataset, seed), x, y


def probe_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int,
               steps: int = 3) -> float:  # fmt: skip
    """Seconds per training step (forward, backward) of this job's model on this
    board, measured on a copy so the job's state and random streams stay untouched."""
    twin = copy.deepcopy(model)
    xb, yb = x[:batch], y[:batch]
    best = float("inf")
    for _ in range(steps + 1):  # the first step warms up the allocator
        start = time.perf_counter()
        twin.zero_grad()
        torch.nn.functional.cross_entropy(twin(xb), yb).backward()
        best = min(best, time.perf_counter() - start)
    return best

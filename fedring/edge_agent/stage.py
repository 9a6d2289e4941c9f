"""A `fedring agent`'s part in a pipeline job: one stage (one replica of it), trained over
the daemon's link.

The coordinator's manifest (``mode = "pipeline"``) names this agent's stage and
replica (of D), the agent holding every stage's replicas, the boards and the cut
points it decided; with D > 1 also its shard's entry (replica d trains on shard d of
the job's sharding, checked by sha256; D = 1: the whole training set). The stage
rebuilds that plan from the model's shapes (never re-deriving the split), checks its
own board's budget against the plan's estimate, and lays out only its own layers
(`pipeline.materialize`). The next ``model`` message carries those layers' initial
parameters, checked against the manifest's sha256. Training then runs in a thread
(`pipeline.grid.build_worker`, the same stage code as `fedring simulate`), its
activations and gradients in signed frames between the agents, while the daemon
keeps listening: a ``bye`` (halt) or a lost coordinator stops it at once.

With D > 1 the D replicas of a stage all-reduce its gradient in their own ring
(`Reducer`: the job's compression, group-top-k with error feedback). Replica 0 of
each stage uploads its state every `checkpoint_every` steps (parameters, buffers,
momentum: `pipeline.assignment.stage_state`) with its sha256, and replica 0 of the
last stage sends its loss every `eval_every` steps; at the end replica 0 uploads its
final state and every replica says ``bye`` with its state's sha256, its peak RSS
(this job's: the kernel's peak is reset when the job starts), bytes, seconds and
its counters' gain since the job's first manifest (as a data-parallel agent's). A
stage that fails says ``nack`` with the reason; the daemon stays up for the next job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedring import build
from fedring.collective.channel import CollectiveError, CollectiveTimeout, PeerChannel
from fedring.config import JobSpec, SpecError
from fedring.counters import Counters
from fedring.edge_agent.running import wait_for_go
from fedring.edge_agent.worker import Halted, JobRefused
from fedring.engine.gate import CodeRefused
from fedring.engine.reducer import ReducerSettings
from fedring.engine.sampler import ShardSampler
from fedring.engine.task import Task, TaskError
from fedring.firmware_profiles.schema import Profile
from fedring.logs_limit import LogLimiter
from fedring.pipeline.assignment import (
    load_stage_state,
    plan_from_shapes,
    shard_of,
    stage_state,
    state_numel,
)
from fedring.pipeline.cost import StageSplitError
from fedring.pipeline.grid import GridWorker, PipelineSettings, ShardBatches, build_worker
from fedring.pipeline.materialize import materialize, meta_layers
from fedring.pipeline.memory import peak_rss_mb, reset_peak_rss, return_freed_memory
from fedring.pipeline.partition import Board, StagePlan
from fedring.pipeline.stage import WireSettings
from fedring.training.datasets import Dataset, DatasetError
from fedring.training.lr import LrSchedule
from fedring.training.models import flat_bytes, flat_sha256
from fedring.training.sharding import ShardError
from fedring.transport import topics
from fedring.transport.base import Deadline
from fedring.transport.mqtt import MqttEndpoint, MqttLink
from fedring.wire.control import ControlCodec, ControlMessage

log = logging.getLogger(__name__)
SEND_S = 30.0
Send = Callable[..., None]  # the daemon's `_send(job, kind, doc, blob=b"", *, round=0)`


@dataclass
class _StageRun:
    job: str
    epoch: int
    stage: int
    members: list[str]  # the agent of stage s replica d: members[s * replicas + d]
    spec: JobSpec
    task: Task
    data: Dataset
    plan: StagePlan
    module: torch.nn.Module
    params_sha256: str
    start_step: int
    replica: int = 0
    replicas: int = 1
    x: torch.Tensor | None = None  # this replica's shard (None: the whole training set)
    y: torch.Tensor | None = None
    halt: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)  # every stage is ready
    thread: threading.Thread | None = None
    endpoint: MqttEndpoint | None = None
    state: torch.Tensor | None = None  # to start from: initial, or a checkpoint's
    uploaded: int = -1  # the step of this stage's last checkpoint upload
    acked: int = -1  # the last step whose upload the coordinator saved
    cond: threading.Condition = field(default_factory=threading.Condition)

    def saved(self, step: int) -> None:
        with self.cond:
            self.acked = max(self.acked, step)
            self.cond.notify_all()

    def wait_saved(self, patience: float) -> None:
        """Until the coordinator saved the last upload: uploads never pile up in its
        inbox faster than it stores them."""
        deadline = Deadline.after(patience)
        with self.cond:
            while self.acked < self.uploaded and not self.halt.is_set():
                if deadline.expired:
                    raise CollectiveTimeout(f"stage {self.stage}: no ack of the checkpoint of "
                                            f"step {self.uploaded}")  # fmt: skip
                self.cond.wait(min(0.2, deadline.remaining()))

    @property
    def channel_job(self) -> str:
        return f"{self.job}.e{self.epoch}"


class StageHost:
    """The daemon's pipeline jobs: `handle` takes the control messages that are theirs."""

    def __init__(self, me: str, codec: ControlCodec, counters: Counters, send: Send, *,
                 data_dir: Path | None, budget: Profile | None,
                 allowed_modules: tuple[str, ...]) -> None:  # fmt: skip
        self.me, self.codec, self.counters, self.send = me, codec, counters, send
        self._log = LogLimiter(log, f"messages {me} did not expect")
        self.data_dir, self.budget, self.allowed_modules = data_dir, budget, allowed_modules
        self.current: _StageRun | None = None
        self.link: MqttLink | None = None
        self.counters_at_job: tuple[str, dict[str, int]] = ("", {})  # at a job's first manifest

    def handle(self, msg: ControlMessage, link: MqttLink) -> bool:
        """True if `msg` belonged to a pipeline job (and was dealt with)."""
        self.link = link
        if msg.kind == "manifest" and msg.doc.get("mode") == "pipeline":
            self._on_manifest(msg)
            return True
        run = self.current
        if run is None or msg.job != run.job:
            return False
        if msg.kind == "model":
            self._on_model(run, msg)
        elif msg.kind == "ack" and msg.doc.get("epoch") == run.epoch:
            if msg.doc.get("go") is True:
                run.go.set()
            elif type(msg.doc.get("step")) is int:
                run.saved(msg.doc["step"])
        elif msg.kind == "bye":
            self.halt(f"coordinator said {msg.doc.get('why', '')!r}")
            if msg.doc.get("why") == "done":
                self.join()
                self.current = None
                self.link.watch_peers([])  # the coordinator's presence alone
        return msg.kind in ("model", "ack", "bye")

    def halt(self, why: str) -> None:
        run = self.current
        if run is not None and not run.halt.is_set():
            log.info("%s: halting stage %d of %s: %s", self.me, run.stage, run.job, why)
            run.halt.set()
            if self.link is not None:
                self.link.interrupt(run.channel_job)

    def join(self) -> None:
        run = self.current
        if run is not None and run.thread is not None:
            run.thread.join()

    # -- start --------------------------------------------------------------------

    def _on_manifest(self, msg: ControlMessage) -> None:
        self.halt("a new manifest arrived")
        self.join()
        self.current = None
        if self.counters_at_job[0] != msg.job:  # a re-formation's manifest keeps the baseline
            self.counters_at_job = (msg.job, self.counters.snapshot())
        doc = msg.doc
        try:
            self.codec.key = bytes.fromhex(str(doc["key"]))  # so that a refusal is signed
            self.current = self._prepare(doc)
            if self.link is not None:  # the stages and replicas this one exchanges with
                self.link.watch_peers(self.current.members)
        except (KeyError, TypeError, ValueError, SpecError, DatasetError, TaskError,
                StageSplitError, ShardError) as exc:  # fmt: skip
            self.counters.add("job_refused")
            if isinstance(exc, CodeRefused):  # code or a path this agent does not allow
                self.counters.add("code_refused")
            log.error("%s refused pipeline job %s: %s", self.me, msg.job, exc)
            if self.link is not None:  # in no job now: an earlier stage's peers are not ours
                self.link.watch_peers([])
            self.send(msg.job, "nack", {"epoch": doc.get("epoch"), "why": f"refused: {exc}"})

    def _prepare(self, doc: dict[str, Any]) -> _StageRun:
        spec = JobSpec.from_mapping(doc["spec"])
        stage, replica, replicas = int(doc["stage"]), int(doc.get("replica", 0)), int(
            doc.get("replicas", 1))
        members = [topics.check_id("peer", str(m)) for m in doc["members"]]
        count = len(doc["starts"])
        if (replicas < 1 or len(members) != count * replicas or not 0 <= stage < count
                or not 0 <= replica < replicas or members[stage * replicas + replica] != self.me):
            raise JobRefused(f"{self.me} is not stage {stage} replica {replica} of {members}")
        boards = [Board(str(n), float(g), float(b)) for n, g, b in doc["boards"]]
        task = build.task_of(spec, self.data_dir, self.allowed_modules)
        data = task.dataset(spec.seed)
        layers = meta_layers(spec.model, data.feature_shape, data.num_classes)
        plan = plan_from_shapes(layers, data.feature_shape, boards, batch_size=spec.batch_size,
                                micro_batches=spec.micro_batches, schedule=spec.pipeline_schedule,
                                starts=[int(v) for v in doc["starts"]])  # fmt: skip
        mine = plan.stages[stage]
        if self.budget is not None and mine.memory_mb > self.budget.ram_budget_mb:
            raise JobRefused(f"stage {stage} needs ~{mine.memory_mb:.1f} MB, {self.budget.name}'s "
                             f"budget is {self.budget.ram_budget_mb} MB")  # fmt: skip
        x, y = shard_of(data, doc.get("shard_entry"), replica, replicas, scheme=spec.sharding,
                        seed=spec.seed)
        module = materialize(layers, mine.start, mine.end, seed=spec.seed)
        log.info("%s: stage %d of %d (replica %d of %d), layers %d..%d, %s params", self.me,
                 stage, count, replica, replicas, mine.start, mine.end - 1,
                 f"{mine.params:,}")  # fmt: skip
        return _StageRun(topics.check_id("job", str(doc["job"])), int(doc["epoch"]), stage,
                         members, spec, task, data, plan, module, str(doc["params_sha256"]),
                         int(doc.get("start_step", 0)), replica, replicas, x, y)  # fmt: skip

    def _on_model(self, run: _StageRun, msg: ControlMessage) -> None:
        if run.thread is not None or len(msg.blob) % 4:
            self.counters.add("model_unexpected")
            why = "its stage runs" if run.thread is not None else "not whole float32 values"
            self._log.warning(msg.src, "model_unexpected", "%s: a model of %d bytes from %s for "
                              "round %d, job %s: %s; ignored", self.me, len(msg.blob), msg.src,
                              msg.round, msg.job, why)  # fmt: skip
            return
        # A stage without parameters (a flatten or an activation alone) gets an empty
        # state, which `frombuffer` refuses with a ValueError that would end the daemon.
        flat = (
            torch.frombuffer(bytearray(msg.blob), dtype=torch.float32)
            if msg.blob
            else torch.zeros(0)
        )
        sizes = (state_numel(run.module, False), state_numel(run.module, True))
        why = ""
        if flat_sha256(flat) != run.params_sha256:
            self.counters.add("model_bad_sha256")
            why = "refused: the stage's state does not match the manifest's sha256"
        elif flat.numel() not in sizes:
            self.counters.add("model_bad_shape")
            why = f"refused: a state of {flat.numel()} values for a stage of {sizes}"
        if why:
            log.error("%s: %s", self.me, why)
            self.send(run.job, "nack", {"epoch": run.epoch, "why": why})
            self.current = None
            return
        assert self.link is not None
        # Open now: the neighbours' frames are held from here on, and the coordinator
        # says "go" only once every stage has acknowledged, so none is dropped.
        run.endpoint = self.link.endpoint(run.channel_job)
        run.state = flat
        run.thread = threading.Thread(target=self._body, args=(run,), daemon=True,
                                      name=f"{self.me}-stage{run.stage}")  # fmt: skip
        self.send(run.job, "ack", {"epoch": run.epoch, "stage": run.stage})
        run.thread.start()

    # -- training -----------------------------------------------------------------

    def _body(self, run: _StageRun) -> None:
        try:
            self.send(run.job, "bye", self._train(run))
        except CollectiveError as exc:
            self.counters.add("stage_stopped")
            log.warning("%s: stage %d stopped: %s: %s", self.me, run.stage, type(exc).__name__, exc)
            self.send(run.job, "nack", {"epoch": run.epoch, "why": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:  # a bug or a bad job: report it, keep the daemon up
            self.counters.add("stage_error")
            log.exception("%s: stage %d failed", self.me, run.stage)
            self.send(run.job, "nack", {"epoch": run.epoch, "why": f"error: {exc}"})

    def _worker(self, run: _StageRun, channel: PeerChannel) -> GridWorker:
        spec, data = run.spec, run.data
        x = data.x_train if run.x is None else run.x
        y = data.y_train if run.y is None else run.y
        sampler = ShardSampler(len(x), batch_size=spec.batch_size, seed=spec.seed,
                               rank=run.replica)  # fmt: skip
        for _ in range(run.start_step):
            sampler.next_batch()
        wire = WireSettings(spec.activation_dtype, spec.timeout_s)  # type: ignore[arg-type]
        d_count = run.replicas
        return build_worker(
            run.module, run.plan, run.stage, run.replica, d_count,
            PipelineSettings(spec.micro_batches, spec.pipeline_schedule, wire, spec.topology),
            channel, loss_fn=run.task.loss,
            make_optimizer=lambda m: build.optimizer(spec, run.task, m),
            reducer_settings=build.reducer_settings(spec) if d_count > 1
            else ReducerSettings(compression="none"),
            next_batch=ShardBatches(x, y, sampler),
            names=lambda s, d: run.members[s * d_count + d],
        )  # fmt: skip

    def _train(self, run: _StageRun) -> dict[str, Any]:
        assert run.endpoint is not None
        spec, endpoint = run.spec, run.endpoint
        ready = Deadline.after(max(60.0, 3 * spec.timeout_s))
        wait_for_go(run.go, run.halt, ready, f"{self.me}'s first step")
        return_freed_memory()  # process-wide, and harmless to the daemon's other work
        reset_peak_rss()
        channel = PeerChannel(endpoint, run.channel_job, key=self.codec.key, counters=self.counters)
        worker = self._worker(run, channel)
        assert run.state is not None
        load_stage_state(run.module, run.state, worker.optimizer)  # with its momentum, if any
        run.state = None
        lr = LrSchedule(base_lr=spec.lr, scaling=spec.lr_scaling, n_agents=run.replicas,
                        batch_size=spec.batch_size, ref_batch=spec.ref_batch,
                        warmup_steps=spec.warmup_steps)  # fmt: skip
        last = run.stage == len(run.plan.stages) - 1 and run.replica == 0
        first = run.replica == 0  # the replica that uploads the stage's states
        start = time.perf_counter()
        losses: list[float] = []
        for step in range(run.start_step, spec.rounds):
            if run.halt.is_set():
                raise Halted(f"{self.me}: halted before step {step}")
            if first and step > run.start_step and step % spec.checkpoint_every == 0:
                self._upload(run, step, stage_state(run.module, worker.optimizer), final=False)
                if run.halt.is_set():
                    raise Halted(f"{self.me}: halted at step {step}")
            worker.train_step(step, lr.lr_at(step))
            if last:
                losses.append(worker.losses[-1])
                if (step + 1) % spec.eval_every == 0 or step + 1 == spec.rounds:
                    self._metrics(run, step + 1, sum(losses) / len(losses), lr.lr_at(step))
                    losses = []
        train_s = time.perf_counter() - start
        final = stage_state(run.module)
        if first:
            self._upload(run, spec.rounds, final, final=True)
        stage = worker.stage
        return {
            "epoch": run.epoch, "stage": run.stage, "replica": run.replica, "steps": spec.rounds,
            "sha256": flat_sha256(final), "peak_rss_mb": round(peak_rss_mb(), 1),
            "bytes_sent": endpoint.stats.bytes_sent, "payload_bytes": stage.payload_bytes_sent,
            "forward_s": stage.forward_s, "backward_s": stage.backward_s,
            "micro_run": stage.micro_run, "train_seconds": round(train_s, 2),
            "final_loss": worker.losses[-1] if worker.losses else None,
            "counters": self._job_counters(),
        }  # fmt: skip

    def _job_counters(self) -> dict[str, int]:
        """What the counters gained since this job's first manifest (non-zero only), as
        a data-parallel agent's bye carries them."""
        before = self.counters_at_job[1]
        now = self.counters.snapshot()
        return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}

    def _upload(self, run: _StageRun, step: int, flat: torch.Tensor, *, final: bool) -> None:
        run.wait_saved(3 * run.spec.timeout_s)
        run.uploaded = step
        doc = {"epoch": run.epoch, "stage": run.stage, "step": step, "final": final,
               "sha256": flat_sha256(flat)}  # fmt: skip
        self.send(run.job, "model", doc, flat_bytes(flat), round=step)

    def _metrics(self, run: _StageRun, step: int, loss: float, lr: float) -> None:
        assert self.link is not None
        row = {"round": step, "loss": loss, "lr": lr, "epoch": run.epoch, "stage": run.stage}
        [frame] = self.codec.encode("metrics", run.job, topics.COORDINATOR, row)
        self.link.publish(topics.metrics(run.job, self.me), frame, Deadline.after(SEND_S))


"""`fedring coordinator run` for a job with ``pipeline_stages`` = S > 1: an S x D grid of agents.

1. Enrol: wait (with a deadline) for ``agents`` = S x D agents online with a hello;
   stage s replica d goes to the (s*D + d)-th by id (`pipeline_grid`); more enrolled
   boards stay idle (spares). With D > 1 each stage's D replicas all-reduce its
   gradient in their own ring (group-top-k + error feedback per the job's fields),
   replica d on shard d of the data.
2. Plan once: the model's layers on PyTorch's ``meta`` device, their costs counted
   from shapes (`pipeline.assignment`), split within each stage's board budget (its
   hello's profile). The cut points go to every stage; no stage re-derives them, so
   the same seed gives the same split and the same model on any machine load.
3. Start: each agent gets a manifest (its stage, the members by stage, the boards,
   the cut points, the spec, the key, its replica and shard entry) and its own stage's
   initial parameters only (sha256 in the manifest). Stages train over their MQTT
   links (`edge_agent.stage`); replica 0 of each stage uploads its state every
   `checkpoint_every` steps (kept under OUT/stages/ once every stage's upload of a
   step is in), and replica 0 of the last stage reports its loss every `eval_every`.
4. End: replica 0 of every stage uploads its final state (hash-checked), every member
   says ``bye`` with its state's sha256 (the replicas of a stage must agree) and its
   counters (checked: `byes.read_counters`; refused ones are left out and
   counted, ``bad_stage_counters``); the
   coordinator reassembles the model, evaluates it, writes the files
   (`pipeline_files`) and the summary, exports ONNX where it can.
5. Failure: a stage lost (last-will or silence), a stage that stops (``nack``), or no
   word for `stall_s`: the others are halted, and the job ends with a typed error
   naming the stage, replica and agent (`StageLost`, `StageFailed`, `StageStalled`), a log
   line and a counter; the last complete checkpoint stays on disk and the daemons
   stay up for the next job. Nothing here waits without a deadline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

import torch

from fedring.build import task_of
from fedring.config import JobSpec
from fedring.coordinator import pipeline_files as files
from fedring.coordinator.byes import read_counters
from fedring.coordinator.lease import check_broker
from fedring.coordinator.membership import number
from fedring.coordinator.outputs import append_row
from fedring.coordinator.pipeline_fleet import (
    PipelineError,
    StageFailed,
    StageFleet,
    StageLost,
    StageStalled,
    refused,
)
from fedring.coordinator.pipeline_grid import (
    Grid,
    GridJob,
    grid_summary,
    replicas_differ,
    shard_entries,
    stage_boards,
)
from fedring.coordinator.service import Options
from fedring.counters import Counters
from fedring.firmware_profiles.apply import RUNTIME_MB
from fedring.logs_limit import LogLimiter
from fedring.pipeline.assignment import plan_from_shapes, stage_state
from fedring.pipeline.cost import StageSplitError
from fedring.pipeline.materialize import materialize, meta_layers
from fedring.pipeline.partition import Board, StagePlan
from fedring.report import atomic_write, jsonl
from fedring.training.models import flat_bytes, flat_sha256, params_sha256
from fedring.transport.base import Deadline
from fedring.transport.mqtt import BrokerConfig, Control
from fedring.wire.control import ControlMessage

__all__ = ["PipelineCoordinator", "PipelineError", "StageFailed", "StageLost", "StageStalled"]
log = logging.getLogger(__name__)
BLAME_S = 3.0  # after a stage's nack, how long to look for the member that died


class PipelineCoordinator:
    def __init__(self, spec: JobSpec, cfg: BrokerConfig, opts: Options) -> None:
        if spec.pipeline_stages < 2:
            raise ValueError("a pipeline job has pipeline_stages >= 2")
        self.spec, self.cfg, self.opts = spec, cfg, opts
        self.counters = Counters()
        self.fleet = StageFleet(cfg, self.counters)
        self.events: list[dict[str, Any]] = []  # re-formations
        self.rows: dict[int, dict[str, Any]] = {}  # the last stage's, by step (a redo replaces)
        self._log = LogLimiter(log, "messages refused by the coordinator")

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        spec, s_count = self.spec, self.spec.pipeline_stages
        if spec.agents % s_count:
            why = (f"field 'agents'={spec.agents}: a pipeline job runs S x D agents, a multiple "
                   f"of pipeline_stages = {s_count}")  # fmt: skip
            raise refused(self.counters, "pipeline_refused", why)
        if spec.task:
            why = (f"field 'task'={spec.task!r}: pipeline jobs through the coordinator take a "
                   "built-in model (field 'model')")  # fmt: skip
            raise refused(self.counters, "pipeline_refused", why)
        if spec.pipeline_cost != "counted":  # its layers live on the meta device: no timing
            why = (f"field 'pipeline_cost'={spec.pipeline_cost!r}: the coordinator splits "
                   "by counted multiply-adds (the same split on any load)")  # fmt: skip
            raise refused(self.counters, "pipeline_refused", why)
        task = task_of(spec)
        data = task.dataset(spec.seed)
        layers = meta_layers(spec.model, data.feature_shape, data.num_classes)
        check_broker(self.cfg)  # one coordinator at a broker (`lease`)
        self.fleet.link.connect()
        try:
            members = self.fleet.enrol(spec.agents, self.opts.enrol_timeout_s)
            boards = stage_boards([self.fleet.board(a) for a in members], s_count)
            shards = shard_entries(data, spec.agents // s_count, spec.sharding, spec.seed)
            try:
                plan = plan_from_shapes(
                    layers, data.feature_shape, boards, batch_size=spec.batch_size,
                    micro_batches=spec.micro_batches, schedule=spec.pipeline_schedule,
                )  # fmt: skip
            except StageSplitError as exc:
                why = f"no split of {spec.model} fits the boards: {exc}"
                raise refused(self.counters, "pipeline_no_split", why) from None
            log.info("pipeline plan:\n%s", plan.describe())
            modules = [materialize(layers, st.start, st.end, seed=spec.seed) for st in plan.stages]
            self.opts.out.mkdir(parents=True, exist_ok=True)
            ckpt = files.StageCheckpoints(self.opts.out, s_count)
            initial = {st.index: stage_state(modules[st.index]) for st in plan.stages}
            job = GridJob(f"pp-{os.urandom(4).hex()}", os.urandom(32), Grid(members, s_count))
            if self.opts.feed is not None:
                self.opts.feed.job, self.opts.feed.counters = job.job, self.counters
                self.opts.feed.members(members, f"pipeline {s_count} stages")
            self.fleet.codec.key = job.key
            while True:
                self._start(job, plan, boards, shards, initial if job.epoch == 0 else ckpt.latest)
                try:
                    self._train(job, ckpt)
                except StageLost as exc:
                    job = self._reform(job, exc, ckpt)
                    continue
                return self._finish(job, plan, modules, task, data, ckpt,
                                    time.perf_counter() - start)  # fmt: skip
        finally:
            self.fleet.link.close("offline")

    def _start(self, job: GridJob, plan: StagePlan, boards: list[Board],
               shards: list[dict[str, Any]], states: dict[int, torch.Tensor]) -> None:  # fmt: skip
        """Each member's manifest, then its stage's state (initial, or the checkpoint's)."""
        for i, agent in enumerate(job.members):
            s, d = divmod(i, job.grid.replicas)
            flat = states[s]
            doc = job.manifest(i, self.spec.resolved(), plan, boards, flat_sha256(flat))
            if shards:
                doc["shard_entry"] = shards[d]
            self.fleet.send(job.job, agent, "manifest", doc, sign=False)
            self.fleet.send(job.job, agent, "model", {"epoch": job.epoch, "stage": s},
                            flat_bytes(flat), round=job.start)  # fmt: skip

    def _reform(self, job: GridJob, exc: StageLost, ckpt: files.StageCheckpoints) -> GridJob:
        """A spare board (enrolled, not a member) takes the lost member's place; every
        member rolls back to the last complete checkpoint (replicas start from replica
        0's state, their error-feedback residuals empty). Without a spare, the job fails."""
        spares = sorted(self.fleet.ready() - set(job.members))
        if not spares or ckpt.step < 0 or job.epoch + 1 >= self.opts.max_epochs:
            why = ("no spare board is enrolled" if not spares
                   else "no complete checkpoint to re-form from" if ckpt.step < 0
                   else f"gave up after {job.epoch + 1} epochs")  # fmt: skip
            log.error("pipeline job %s cannot re-form: %s; %s", job.job, exc, why)
            raise StageLost(f"{exc}; {why}", exc.stage, exc.agent, exc.replica) from None
        members = list(job.members)
        index = job.index_of(exc.agent)
        members[index] = spares[0]
        ckpt.pending.clear()  # the dead epoch's partial sets: never mixed with the next's
        self.counters.add("pipeline_reformed")
        place = job.grid.who(index).split(" (")[0]
        why = (f"{place}: {exc.agent} lost, {spares[0]} takes it; every stage rolls "
               f"back to step {ckpt.step}")  # fmt: skip
        log.warning("pipeline job %s re-forms: %s", job.job, why)
        self.events.append({"t": time.time(), "epoch": job.epoch, "why": why})
        return GridJob(job.job, job.key, Grid(members, job.grid.stages), epoch=job.epoch + 1,
                    start=ckpt.step,
                    step=ckpt.step)  # fmt: skip

    # -- training -----------------------------------------------------------------

    def _train(self, job: GridJob, ckpt: files.StageCheckpoints) -> None:
        """Until every stage said bye with its final state; a typed error otherwise."""
        stall = self.opts.stall_s or 3 * self.spec.timeout_s
        acks_by = Deadline.after(self.opts.ack_timeout_s)
        progress = Deadline.after(stall)
        n, s_count = len(job.members), job.grid.stages
        while not (len(job.done) == n and len(job.finals) == s_count):
            if len(job.acks) < n and acks_by.expired:
                missing = [job.members[i] for i in range(n) if i not in job.acks]
                self._fail(job, StageFailed, "stage_no_ack", f"no ack from {missing} within "
                           f"{self.opts.ack_timeout_s:g} s", ckpt)  # fmt: skip
            if progress.expired:
                self._fail(job, StageStalled, "stage_stalled", f"no word from any stage for "
                           f"{stall:g} s (last step {job.step})", ckpt)  # fmt: skip
            item = self.fleet.next(0.5)
            if item is None:
                continue
            if item.kind == "member" and item.event is not None:
                if item.src in job.members and item.event.kind in ("lost", "left"):
                    self._lost(job, item.src, item.event.kind, ckpt)
                continue
            msg = self.fleet.decode(item)
            if msg is None or msg.job != job.job or msg.doc.get("epoch") != job.epoch:
                continue
            i = job.index_of(msg.src)
            if i < 0:
                continue
            progress = Deadline.after(stall)
            if msg.kind == "ack":
                job.acks.add(i)
                if len(job.acks) == n:  # every member holds its layers and listens
                    for agent in job.members:
                        self.fleet.send(job.job, agent, "ack", {"epoch": job.epoch, "go": True})
            elif msg.kind == "nack":
                job.stopped.add(msg.src)
                self._nacked(job, i, str(msg.doc.get("why", "")), ckpt)
            elif msg.kind == "model":
                self._on_state(job, i, msg, ckpt)
            elif msg.kind == "metrics":
                job.step = max(job.step, int(number(msg.doc.get("round"))))
                row = {k: v for k, v in msg.doc.items() if k != "epoch"}
                self.rows[int(number(row.get("round")))] = row
                append_row(self.opts.out, row)
                if self.opts.feed is not None:
                    self.opts.feed.round(row)
                if self.opts.on_round is not None:
                    self.opts.on_round(int(row.get("round", 1)) - 1, row)
            elif msg.kind == "bye":
                job.done[i] = self._bye(job, i, msg)
        for s, flat in job.finals.items():  # the state uploaded is the one the stage ended with
            i = s * job.grid.replicas
            if flat_sha256(flat) != job.done[i].get("sha256"):
                self._fail(job, StageFailed, "stage_final_mismatch", f"{job.grid.who(i)}: its "
                           "final upload is not the state it reports", ckpt, at=(s, 0))  # fmt: skip
        differ = replicas_differ(job.grid, job.done)
        if differ:
            self._fail(job, StageFailed, "stage_replicas_differ", differ, ckpt)

    def _on_state(self, job: GridJob, i: int, msg: ControlMessage,
                  ckpt: files.StageCheckpoints) -> None:  # fmt: skip
        s, d = divmod(i, job.grid.replicas)
        if d:  # replica 0 of a stage uploads its states; another's is not kept
            self.counters.add("stage_state_unexpected")
            log.warning("pipeline: %s sent a state; only replica 0 uploads", job.grid.who(i))
            return
        if len(msg.blob) % 4 or hashlib.sha256(msg.blob).hexdigest() != msg.doc.get("sha256"):
            self._fail(job, StageFailed, "stage_state_bad_sha256",
                       f"{job.grid.who(i)} sent a state whose sha256 does not match",
                       ckpt)  # fmt: skip
        flat = torch.frombuffer(bytearray(msg.blob), dtype=torch.float32)
        step = int(number(msg.doc.get("step")))
        job.step = max(job.step, step)
        if msg.doc.get("final") is True:
            job.finals[s] = flat
            return
        if ckpt.add(s, step, flat):
            log.info("pipeline checkpoint: every stage at step %d", step)
        # Saved: that stage may send its next upload.
        self.fleet.send(job.job, msg.src, "ack", {"epoch": job.epoch, "step": step})

    def _bye(self, job: GridJob, i: int, msg: ControlMessage) -> dict[str, Any]:
        """Member `i`'s bye, its counters checked: a refused object is left out of the
        summary, counted and logged (rate-limited: a member may say bye again and again)."""
        read = read_counters(msg.doc)
        if read.refused:
            self.counters.add("bad_stage_counters")
            self._log.warning(msg.src, "bad_stage_counters", "pipeline job %s: the bye of %s: "
                              "%s; its counters are left out", job.job, job.grid.who(i),
                              read.refused)  # fmt: skip
        return {**msg.doc, "counters": read.counters}

    # -- failures -----------------------------------------------------------------

    def _lost(self, job: GridJob, agent: str, kind: str, ckpt: files.StageCheckpoints) -> None:
        i = job.index_of(agent)
        self._fail(job, StageLost, "stage_lost", f"{job.grid.who(i)} {kind} near step "
                   f"{job.step}", ckpt, gone=agent, at=job.grid.where(agent))  # fmt: skip

    def _nacked(self, job: GridJob, i: int, why: str, ckpt: files.StageCheckpoints) -> None:
        """A stage stopped: blame the member that died, if one did (its neighbours see
        its last-will as soon as we do), else the stage that said so."""
        deadline = Deadline.after(BLAME_S)
        while not deadline.expired:
            gone = [a for a in job.members if not self.fleet.online(a)]
            if gone:
                self._lost(job, gone[0], "lost", ckpt)
            self._stopping(job, self.fleet.next(0.1))
        at = divmod(i, job.grid.replicas)
        if why.startswith("refused"):
            self._fail(job, StageFailed, "stage_refused", f"{job.grid.who(i)} {why}", ckpt,
                       at=at)  # fmt: skip
        self._fail(job, StageFailed, "stage_failed", f"{job.grid.who(i)} stopped near step "
                   f"{job.step}: {why}", ckpt, at=at)  # fmt: skip

    def _fail(self, job: GridJob, kind: type[PipelineError], counter: str, why: str,
              ckpt: files.StageCheckpoints, gone: str = "",
              at: tuple[int, int] = (-1, -1)) -> None:  # fmt: skip
        """Halt the other stages (bounded), log, count, and raise `kind` naming the
        (stage, replica) `at` and the agent `gone`."""
        self.counters.add(counter)
        kept = (f"last complete checkpoint: step {ckpt.step} in {ckpt.dir}" if ckpt.step >= 0
                else "no complete checkpoint yet")  # fmt: skip
        message = f"pipeline job {job.job}: {why}; {kept}"
        # A lost stage is re-formed on a spare when one is enrolled (`_reform`): a
        # warning here, an error there only if it cannot be.
        log.log(logging.WARNING if kind is StageLost else logging.ERROR, "%s", message)
        online = {a for a in job.members if a != gone and self.fleet.online(a)}
        for agent in online:
            self.fleet.send(job.job, agent, "bye", {"epoch": job.epoch, "why": "halt"})
        deadline = Deadline.after(self.opts.halt_timeout_s)
        while online - job.stopped and not deadline.expired:
            self._stopping(job, self.fleet.next(0.2))
        raise kind(message, at[0], gone, at[1])

    def _stopping(self, job: GridJob, item: Control | None) -> None:
        """Note a stage that stopped (nack, bye) or went, while the job winds down."""
        if item is not None and item.kind == "member" and item.event is not None:
            if item.event.kind != "joined":
                job.stopped.add(item.src)
            return
        msg = self.fleet.decode(item) if item is not None else None
        if msg is not None and msg.job == job.job and msg.kind in ("nack", "bye"):
            job.stopped.add(msg.src)

    # -- the end ------------------------------------------------------------------

    def _finish(self, job: GridJob, plan: Any, modules: list[Any], task: Any, data: Any,
                ckpt: files.StageCheckpoints, wall: float) -> dict[str, Any]:  # fmt: skip
        for agent in job.members:
            self.fleet.send(job.job, agent, "bye", {"epoch": job.epoch, "why": "done"})
        out = self.opts.out
        model = files.reassemble(modules, job.finals)
        files.write_models(out, modules, model)
        test_loss, accuracy = task.evaluate(model, data)
        summary: dict[str, Any] = {
            "job": job.job, **grid_summary(job.grid, plan, job.done, RUNTIME_MB),
            "final_accuracy": accuracy, "test_loss": test_loss,
            "model_sha256": params_sha256(model),
            "epochs": job.epoch + 1, "reformations": job.epoch, "events": self.events,
            "checkpoint_step": ckpt.step, "checkpoint_dir": str(ckpt.dir),
            "model": str(out / "model.pt"), "wall_seconds": wall,
        }  # fmt: skip
        if self.opts.export_onnx:
            summary["onnx"] = files.export(model, data.feature_shape, out, self.counters)
        summary["coordinator_counters"] = self.counters.snapshot()
        atomic_write(out / "metrics.jsonl", jsonl([self.rows[r] for r in sorted(self.rows)]))
        atomic_write(out / "summary.json", _dumps(summary))
        return summary


def _dumps(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"

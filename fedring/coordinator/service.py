"""`fedring coordinator run JOB.toml --broker URL`: drives one job over MQTT.

1. Enrol: wait (with a deadline) until `min_agents` agents are online and have
   said hello; order the ring by their measured bandwidth (fastest first).
2. Plan: load the dataset, shard it, hash every shard and the initial model; the
   job gets a fresh id and a random key.
3. Segments: each member gets a manifest (members in ring order, its shard, the
   spec, the key, the round to start from) and, after round 0, the checkpoint's
   parameters. The head of the ring uploads its parameters after every round;
   they are checkpointed atomically. Agents report metrics and, on evaluation
   rounds, their model's sha256, which must agree.
4. Failures: a member lost (last-will), a failed round (``nack``), a member that
   comes back, or no progress for `stall_s` ends the segment: the survivors are
   halted and a new epoch starts from the last checkpoint with the ring
   re-formed from whoever holds a shard and is online.
5. End: every member says ``bye`` with its model hash; the coordinator checks
   they are identical, writes the final checkpoint and `summary.json`.

Why one module of about 420 lines: the coordinator is one state machine (enrol,
plan, segments, re-formation, finish) over one checkpoint and one link; the
fleet's order and probes are in `membership`, the files in `outputs` and
`checkpoint`. Issue 15 (the star through the coordinator) is where it splits.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedring.build import needs_centre, opens_centre, plan
from fedring.collective.torus import layout_name
from fedring.config import JobSpec
from fedring.coordinator import outputs
from fedring.coordinator.centre import StarCentre
from fedring.coordinator.checkpoint import Checkpoint
from fedring.coordinator.collectives import CollectivePlans
from fedring.coordinator.degrade import Degrade
from fedring.coordinator.lease import check_broker
from fedring.coordinator.manifest import segment_docs
from fedring.coordinator.membership import Fleet, Suspects, number, reported_lost
from fedring.counters import Counters
from fedring.engine.plan import Plan
from fedring.engine.resync import Drift
from fedring.engine.resync import summarise as summarise_drift
from fedring.training.models import flat_sha256, set_flat_params
from fedring.training.sharding import ShardManifest
from fedring.transport import topics
from fedring.transport.base import Deadline, TransportError
from fedring.transport.mqtt import SILENT_AFTER, BrokerConfig, Control, MqttLink
from fedring.wire.control import ControlCodec, ControlMessage

log = logging.getLogger(__name__)
SEND_S = 10.0
# Rounds between the first and last member to halt that a re-plan resumes across: an
# agent keeps its last 4 rounds' states (`edge_agent.worker`), a synchronous ring
# halts within one round.
HELD_SPREAD = 2
# Seconds past a peer's silence limit (SILENT_AFTER x its keep-alive) before the link's
# silence check, which runs every 0.25 s, has surely seen a peer that stopped beating.
VERDICT_MARGIN_S = 1.0


class CoordinatorError(RuntimeError):
    """The job could not run: too few agents, every agent lost, no progress."""


@dataclass
class Options:
    out: Path
    min_agents: int = 0  # 0: the job's `agents`
    enrol_timeout_s: float = 120.0
    ack_timeout_s: float = 60.0
    halt_timeout_s: float = 10.0
    stall_s: float = 0.0  # 0: 3 x the job's timeout_s
    max_epochs: int = 50
    resume: bool = False
    export_onnx: bool = True  # OUT/model.onnx from the final checkpoint, checked with ORT
    on_round: Callable[[int, dict[str, Any]], None] | None = None


@dataclass
class _Epoch:
    number: int
    members: list[str]
    start: int
    acks: set[str] = field(default_factory=set)
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)  # an asynchronous job goes on without them
    held: str = ""  # sha256 of the state at `start` every member holds (no model sent)
    halted: dict[str, tuple[int, str]] = field(default_factory=dict)  # round, sha256 at halt


class Coordinator:
    def __init__(self, spec: JobSpec, cfg: BrokerConfig, opts: Options) -> None:
        self.spec, self.cfg, self.opts = spec, cfg, opts
        self.counters = Counters()
        self.codec = ControlCodec(topics.COORDINATOR, counters=self.counters)
        self.link: MqttLink | None = None
        self.centre: StarCentre | None = None  # a star or async job's centre
        self.plan: Plan | None = None  # computed once: the initial model, the evaluator
        self.fleet = Fleet()  # hellos and probes: ring order, frame size, patience
        self.suspects = Suspects()  # peers members reported lost: out until the link agrees
        self.ck: Checkpoint | None = None
        self.hashes: dict[int, dict[str, str]] = {}
        self.resynced: set[int] = set()  # rounds that ended with the head's parameters
        self.drifts: list[tuple[str, int, Drift]] = []  # each member's, before a re-sync
        self.epochs = 0
        self.last_row: dict[str, Any] = {}
        self.rows: dict[int, dict[str, Any]] = {}  # the head's metrics by round (a redo replaces)
        self.refused: dict[str, str] = {}  # agents that cannot take this job -> why
        self.events: list[dict[str, Any]] = []  # wall-clock times of re-formations
        self.t0: float | None = None  # training starts: rows carry "wall_s" since then
        self.start = time.perf_counter()
        self.wall_before = 0.0  # seconds earlier coordinator processes ran this job
        self.degrade = Degrade(spec)  # a ring that keeps breaking goes asynchronous
        self.collectives = CollectivePlans()  # each epoch's collective (`auto`: planned)
        self.replanning = False  # the epoch ends because `auto` re-plans, not a break

    # -- the job ------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.start = time.perf_counter()
        saved = Checkpoint.load(self.opts.out) if self.opts.resume else None  # before the broker
        check_broker(self.cfg)  # one coordinator at a broker (`lease`)
        self.link = MqttLink(
            self.cfg, topics.COORDINATOR, control_from=("*",), listen_hellos=True, watch=True,
            counters=self.counters,
        ).connect()  # fmt: skip
        try:
            ck = self._resume(saved) if saved is not None else self._enrol_and_plan()
            self.ck = ck
            self.wall_before = ck.wall_s
            self.rows = outputs.load_rows(self.opts.out, up_to=ck.round, keep=saved is not None)
            self.codec.key = ck.key
            if opens_centre(self.spec):
                self.centre = StarCentre(self.link, ck.job, ck.key, self.counters)
            self._publish_manifest("running")
            members = self._members()
            epoch = ck.epoch + 1 if self.opts.resume else 0
            last: _Epoch | None = None
            while True:
                if not members:
                    raise CoordinatorError("no agent holding a shard is online")
                ep = _Epoch(epoch, members, ck.round)
                if self.replanning and last:  # the same members go on from where they halted
                    ep.start, ep.held = self._held_round(last, members) or (ck.round, "")
                self.replanning = False
                done, last = self._run_segment(ep), ep
                if done and self.degrade.returning:
                    done = self._back_to_ring(ep)
                elif not done and not self.replanning and (why := self.degrade.broke(ck.round)):
                    log.warning(why)
                    self.counters.add("degraded_to_async")
                    self.events.append({"t": time.time(), "epoch": ep.number, "why": why})
                if done:
                    return self._finish(ep, self._wall())
                self.epochs += 1
                if self.epochs >= self.opts.max_epochs:
                    raise CoordinatorError(f"gave up after {self.epochs} re-formations")
                epoch += 1
                members = self._members()
                self._check_refusals(members)
        finally:
            if self.centre is not None:
                self.centre.close()
            self.link.close("offline")

    def _enrol_and_plan(self) -> Checkpoint:
        want = self.opts.min_agents or self.spec.agents
        deadline = Deadline.after(self.opts.enrol_timeout_s)
        log.info("waiting for %d agents on %s", want, self.cfg.url)
        while len(self._ready()) < want:
            if deadline.expired:
                raise CoordinatorError(
                    f"only {len(self._ready())} of {want} agents enrolled within "
                    f"{self.opts.enrol_timeout_s:g} s: {sorted(self._ready())}"
                )
            self._poll(0.2)
        chosen = self.fleet.order(self._ready())[: self.spec.agents]
        if self.spec.sample > len(chosen):  # a whole number (a fraction is at most 1)
            why = (f"sample={self.spec.sample:g} asks for more agents a round than the "
                   f"{len(chosen)} enrolled: every round trains all {len(chosen)}")  # fmt: skip
            log.warning(why)
            self.events.append({"t": time.time(), "epoch": 0, "why": why})
        spec = self.spec.replace(agents=len(chosen))
        p = self.plan = plan(spec)
        job = topics.check_id("job", f"{_slug(spec.task or spec.dataset)}-{os.urandom(4).hex()}")
        log.info("job %s: %d agents, ring %s", job, len(chosen), chosen)
        return Checkpoint(
            job=job, key=os.urandom(32), spec=spec.resolved(),
            shards={a: i for i, a in enumerate(chosen)}, model_sha256=p.model_sha256,
            shard_manifest=p.manifest.to_dict(), epoch=0, round=0,
            params=p.initial if spec.init == "sent" else None,  # sent, not re-derived
            task=p.task_id.to_dict(),
        )  # fmt: skip

    def _wall(self) -> float:
        """Seconds the job has run, the coordinator processes before this one included."""
        return self.wall_before + time.perf_counter() - self.start

    def _resume(self, ck: Checkpoint) -> Checkpoint:
        why = f"coordinator resumed from round {ck.round}"
        self.events = [*ck.events, {"t": time.time(), "epoch": ck.epoch, "why": why}]
        log.info("resuming job %s from round %d (epoch %d)", ck.job, ck.round, ck.epoch)
        self.spec = JobSpec.from_mapping(ck.spec)
        deadline = Deadline.after(self.opts.enrol_timeout_s)
        while not deadline.expired and not set(ck.shards) <= self._ready():
            self._poll(0.2)
        return ck

    def _check_refusals(self, members: list[str]) -> None:
        """Never shrink silently below the minimum because agents refused the job: a
        lost agent may come back, a refusal (task, shard, memory) is for good."""
        want = self.opts.min_agents or self.spec.agents
        if self.refused and len(members) < want:
            self.counters.add("too_few_after_refusals")
            why = "; ".join(f"{a}: {w}" for a, w in sorted(self.refused.items()))
            raise CoordinatorError(
                f"{len(members)} of the {want} agents the job needs are left after "
                f"{len(self.refused)} refused it ({why}); fix those agents, or lower "
                "--min-agents to run with fewer"
            )

    def _ready(self) -> set[str]:
        assert self.link is not None
        return set(self.fleet.hellos) & set(self.link.peers())

    def _members(self) -> list[str]:
        """The next ring: online holders of a shard that did not refuse the job, once the
        link has its own verdict on every peer a member reported lost (`Suspects`)."""
        assert self.ck is not None and self.link is not None
        self._poll(0.0)
        deadline = Deadline.after(max(map(self._verdict_s, self.ck.shards), default=0.0))
        while self.suspects.pending(self.link.peers(), time.monotonic(), self._verdict_s):
            if deadline.expired:
                break
            self._poll(0.1)
        return self.fleet.order((self._ready() & set(self.ck.shards)) - set(self.refused))

    def _verdict_s(self, agent: str) -> float:
        """How long after a report the link's watch has surely seen `agent` go silent."""
        keepalive = self.fleet.profile(agent, "keepalive_s") or self.cfg.keepalive
        return SILENT_AFTER * keepalive + VERDICT_MARGIN_S

    def _note_nack(self, msg: ControlMessage) -> None:
        """What a member's nack says beyond "stopped": it refused the job (for good), or
        it lost a peer (a suspect until the link's verdict)."""
        if str(msg.doc.get("why", "")).startswith("refused"):
            self.refused[msg.src] = str(msg.doc["why"])
        peer = reported_lost(msg.doc)
        if peer and peer != msg.src:
            self.suspects.report(peer, time.monotonic())

    # -- one segment --------------------------------------------------------------

    def _run_segment(self, ep: _Epoch) -> bool:
        """`_segment`, with a star job's centre serving the epoch's rounds beside it."""
        if self.centre is None or not (needs_centre(self.spec) or self.degrade.active):
            return self._segment(ep)
        evaluate = self._evaluator() if self.asynchronous else None
        spec = self.spec.replace(agents=len(ep.members))
        if self.degrade.active:
            spec = spec.replace(sync="async", async_wait=1)
        self.centre.start(spec, ep.number, ep.members, ep.start, self._params(),
                          self.fleet.frame_bytes(ep.members), evaluate)  # fmt: skip
        try:
            return self._segment(ep)
        finally:
            self.centre.stop()
            self._drain_centre(ep)

    @property
    def asynchronous(self) -> bool:
        """This epoch's deltas go through the centre: an async job, or a degraded ring."""
        return self.spec.sync == "async" or self.degrade.active

    def _back_to_ring(self, ep: _Epoch) -> bool:
        """A degraded epoch ended for calm: checkpoint the centre's model and run the
        ring from its version. True if the job is finished after all."""
        assert self.centre is not None and self.centre.state is not None
        state = self.centre.state
        self._save(ep, state.model.clone(), state.version)
        accuracy = self.rows.get(state.version, {}).get("accuracy", 0.0)
        target = self.spec.target_accuracy
        if state.version >= self.spec.rounds or (target and accuracy >= target):
            self.degrade.returning = False  # it ended asynchronously: summarised as such
            return True
        why = self.degrade.back(state.version)
        log.info(why)
        self.counters.add("back_to_ring")
        self.events.append({"t": time.time(), "epoch": ep.number, "why": why})
        return False

    def _plan(self) -> Plan:
        if self.plan is None:
            self.plan = plan(self.spec)
        return self.plan

    def _params(self) -> torch.Tensor:
        """The model at the checkpoint's round: its parameters, or the plan's initial ones
        for a derived start not yet checkpointed."""
        assert self.ck is not None
        return self.ck.params if self.ck.params is not None else self._plan().initial

    def _evaluator(self) -> Callable[[torch.Tensor], tuple[float, float]]:
        """(test loss, accuracy) of flat parameters: an asynchronous job's centre holds
        the model, so the coordinator evaluates it."""
        p = self._plan()
        model = p.task.model(p.dataset, self.spec.seed)

        def evaluate(params: torch.Tensor) -> tuple[float, float]:
            set_flat_params(model, params)
            return p.task.evaluate(model, p.dataset)

        return evaluate

    def _drain_centre(self, ep: _Epoch) -> bool:
        """An asynchronous job's new versions: rows, progress, checkpoints. True if any."""
        assert self.centre is not None and self.ck is not None
        moved = False
        while True:
            try:
                row, params = self.centre.versions.get_nowait()
            except queue.Empty:
                return moved
            moved = True
            rnd = int(row["round"])
            if self.t0 is not None:
                row["wall_s"] = round(time.perf_counter() - self.t0, 4)
            self.last_row = self.rows[rnd] = row
            outputs.append_row(self.opts.out, row)
            if self.opts.on_round is not None:
                self.opts.on_round(rnd - 1, row)
            if params is not None:
                self._save(ep, params, rnd)
            if self.degrade.calm(rnd) and self.centre.state is not None:
                self.centre.state.stop = True  # every agent gets "end" with its next delta

    def _segment(self, ep: _Epoch) -> bool:
        """Run the ring of `ep.members` until done (True) or until it must re-form."""
        ck = self.ck
        assert ck is not None
        log.info("epoch %d: ring %s from round %d", ep.number, ep.members, ep.start)
        # rounds after the start are run again (another ring may round differently)
        self.hashes = {r: seen for r, seen in self.hashes.items() if r <= ep.start}
        collective = self.collectives.plan(self.spec, ep.number, ep.members, self.fleet,
                                           self._plan().initial.numel(), ep.start)  # fmt: skip
        docs = segment_docs(ck, ep.members, ep.number, ep.start,
                            self.fleet.frame_bytes(ep.members),
                            "async" if self.asynchronous else "ring",
                            self.fleet.mixed(ep.members), collective, ep.held)  # fmt: skip
        for agent, doc in docs.items():
            self._send(agent, "manifest", doc, sign=False)
            if ck.params is not None and not ep.held:
                blob = ck.params.numpy().astype("<f4").tobytes()
                self._send(agent, "model", {"round": ck.round}, blob, round=ck.round)
        stall = self._stall(ep.members)
        acks_by = Deadline.after(self.opts.ack_timeout_s)
        progress = Deadline.after(stall)
        while True:
            if self.centre is not None:
                self.centre.check()  # a centre that failed by itself ends the job with its error
            if self.asynchronous and self._drain_centre(ep):
                progress = Deadline.after(stall)
            if ep.done and set(ep.members) <= set(ep.done) | ep.gone:
                return True
            if len(ep.acks) < len(ep.members) and acks_by.expired:
                missing = sorted(set(ep.members) - ep.acks)
                return self._reform(ep, f"no ack from {missing}")
            if progress.expired:
                self.counters.add("stalled")
                return self._reform(ep, f"no progress for {stall:g} s")
            grown = self._stall(ep.members)  # the probes arrive with the acks
            if grown > stall:
                stall, progress = grown, Deadline.after(grown)
            item = self._next(0.5)
            if item is None:
                continue
            why, moved = self._on_item(ep, item)
            if moved:
                progress = Deadline.after(stall)
            if why:
                return self._reform(ep, why)
            if moved and (why := self.collectives.replan(self.spec)):
                self.counters.add("collective_replanned")
                self.replanning = True  # a planned re-formation: the ring did not break
                return self._reform(ep, why)

    def _held_round(self, ep: _Epoch, members: list[str]) -> tuple[int, str] | None:
        """The newest round every member of the halted `ep` still holds, and its state's
        sha256, when they all halted within the snapshots they keep and agree on it."""
        if members != ep.members or set(ep.halted) != set(members):
            return None
        rounds = [r for r, _ in ep.halted.values()]
        start = min(rounds)
        hashes = {sha for r, sha in ep.halted.values() if r == start}
        if max(rounds) - start > HELD_SPREAD or len(hashes) != 1 or "" in hashes:
            return None
        log.info("epoch %d: every member holds round %d: no roll-back to the checkpoint",
                 ep.number, start)  # fmt: skip
        return start, hashes.pop()

    def _stall(self, members: list[str]) -> float:
        return self.opts.stall_s or self.fleet.stall(members, self.spec.timeout_s)

    def _on_item(self, ep: _Epoch, item: Control) -> tuple[str, bool]:
        """(reason to re-form or "", whether the job moved forward)."""
        assert self.ck is not None
        if item.kind == "member" and item.event is not None:
            who, kind = item.src, item.event.kind
            if who in self.ck.shards and self.centre is not None and self.centre.state is not None:
                self.degrade.moved(self.centre.state.version)  # not calm yet
            if who in ep.members and kind in ("lost", "left"):
                self.counters.add("agent_lost")
                if self.asynchronous:
                    return self._went(ep, who, kind)
                return f"{who} {kind}", False
            if self.asynchronous:
                return "", False  # the epoch's members are fixed; the centre skips the lost
            if kind == "joined" and who in self.ck.shards and who not in ep.members:
                return f"{who} came back", False
            return "", False
        msg = self._decode(item)
        if msg is None or msg.job != self.ck.job:
            return "", False
        epoch = msg.doc.get("epoch")
        if item.kind == "metrics":
            return "", self._on_metrics(ep, msg)
        if epoch != ep.number:
            return "", False  # a late word from an earlier epoch
        if msg.kind == "ack":
            ep.acks.add(msg.src)
            self.fleet.on_ack(msg.src, msg.doc)
            if self.t0 is None and len(ep.acks) == len(ep.members):
                self.t0 = time.perf_counter()  # every agent holds its shard and model
        elif msg.kind == "nack":
            self.counters.add("agent_nack")
            self._note_nack(msg)
            if self.asynchronous:
                return self._went(ep, msg.src, f"stopped: {msg.doc.get('why', '')}")
            return f"{msg.src} stopped: {msg.doc.get('why', '')}", False
        elif msg.kind == "model" and msg.src == ep.members[0]:
            self._checkpoint(ep, msg)
            return "", True
        elif msg.kind == "bye":
            ep.done[msg.src] = msg.doc
            return "", True
        return "", False

    def _went(self, ep: _Epoch, who: str, why: str) -> tuple[str, bool]:
        """An asynchronous job goes on without `who` (no re-formation); say so."""
        if who not in ep.gone:
            ep.gone.add(who)
            log.warning("%s %s; the asynchronous job goes on without it", who, why)
            self.events.append({"t": time.time(), "epoch": ep.number,
                                "why": f"{who} {why}; went on without it"})  # fmt: skip
        return "", False

    def _on_metrics(self, ep: _Epoch, msg: ControlMessage) -> bool:
        row = msg.doc
        rnd = row.get("round")
        if type(rnd) is not int:
            return False
        if row.get("resynced") is True:
            self.resynced.add(rnd)
            drift = Drift(number(row.get("drift_max_abs")), number(row.get("drift_l2")))
            self.drifts.append((msg.src, rnd, drift))
        sha = row.get("sha256")
        if isinstance(sha, str):
            seen = self.hashes.setdefault(rnd, {})
            seen[msg.src] = sha
            if self.spec.sync == "sync" and not self._hashes_agree(rnd, seen):
                self.counters.add("hash_mismatch")
                log.error("round %d: model hashes disagree: %s", rnd, seen)
        if msg.src == ep.members[0]:
            if self.t0 is not None:
                row = {**row, "wall_s": round(time.perf_counter() - self.t0, 4)}
            self.last_row = row
            row = self.collectives.tag(row)
            self.collectives.observe(self.spec, rnd, row)
            self.rows[rnd] = {k: v for k, v in row.items() if k not in ("sha256", "machine")}
            outputs.append_row(self.opts.out, self.rows[rnd])  # a crash keeps the history
            if self.opts.on_round is not None:
                self.opts.on_round(rnd - 1, row)
            return True
        return False

    def _hashes_agree(self, rnd: int, seen: dict[str, str]) -> bool:
        """Members' hashes of round `rnd`: equal across the fleet at a re-sync round,
        equal within each CPU architecture between them (`engine.resync`)."""
        if rnd in self.resynced:
            return len(set(seen.values())) == 1
        classes: dict[str, set[str]] = {}
        for agent, sha in seen.items():
            classes.setdefault(self.fleet.machine(agent), set()).add(sha)
        return all(len(shas) == 1 for shas in classes.values())

    def _checkpoint(self, ep: _Epoch, msg: ControlMessage) -> None:
        assert self.ck is not None
        numel = len(msg.blob) // 4
        if len(msg.blob) != numel * 4 or numel == 0:
            self.counters.add("frame_shape_mismatch")
            return
        params = torch.frombuffer(bytearray(msg.blob), dtype=torch.float32).clone()
        if flat_sha256(params) != msg.doc.get("sha256"):
            self.counters.add("checkpoint_bad_sha256")
            log.error("checkpoint of round %d from %s: sha256 mismatch", msg.round, msg.src)
            return
        self._save(ep, params, msg.round)
        # The head waits for this before starting the round: agents never get more
        # than one round ahead of what a restarted coordinator can resume from.
        self._send(msg.src, "ack", {"epoch": ep.number, "round": msg.round})

    def _save(self, ep: _Epoch, params: torch.Tensor, rnd: int) -> None:
        """Checkpoint the model at the start of round `rnd`, atomically."""
        assert self.ck is not None
        self.ck.params, self.ck.round, self.ck.epoch = params, rnd, ep.number
        self.ck.events, self.ck.wall_s = self.events, self._wall()
        started = time.perf_counter()
        self.ck.save(self.opts.out)
        self.collectives.saves.append(time.perf_counter() - started)  # the head waits on it

    def _reform(self, ep: _Epoch, why: str) -> bool:
        """Halt the survivors and wait until they stopped; the caller starts a new epoch."""
        log.warning("epoch %d ends: %s; re-forming from round %d", ep.number, why,
                    self.ck.round if self.ck else 0)  # fmt: skip
        assert self.link is not None and self.ck is not None
        self.events.append({"t": time.time(), "epoch": ep.number, "why": why})
        for agent in ep.members:
            if agent in self.link.peers():
                self._send(agent, "bye", {"epoch": ep.number, "why": "halt"})
        waiting = {a for a in ep.members if a in self.link.peers()} - set(ep.done)
        deadline = Deadline.after(self.opts.halt_timeout_s)
        while waiting and not deadline.expired:
            item = self._next(0.2)
            if item is None:
                continue
            if item.kind == "member" and item.event is not None:
                if item.event.kind != "joined":
                    waiting.discard(item.src)
                continue
            msg = self._decode(item)
            if msg is None:
                continue
            this_epoch = msg.job == self.ck.job and msg.doc.get("epoch") == ep.number
            if item.kind == "metrics" and this_epoch:
                self._on_metrics(ep, msg)  # a round that ended before the halt may be held
            if msg.kind == "model" and this_epoch and msg.src == ep.members[0]:
                self._checkpoint(ep, msg)
            if msg.kind in ("nack", "bye") and this_epoch:
                waiting.discard(msg.src)
                if msg.kind == "nack":
                    self._note_nack(msg)  # a refusal while the others halt counts too
                committed, sha = msg.doc.get("committed"), msg.doc.get("sha256")
                if msg.kind == "nack" and type(committed) is int and isinstance(sha, str):
                    ep.halted[msg.src] = (committed, sha)
        return False

    # -- the end ------------------------------------------------------------------

    def _finish(self, ep: _Epoch, wall: float) -> dict[str, Any]:
        assert self.ck is not None and self.link is not None
        for agent in ep.members:
            self._send(agent, "bye", {"epoch": ep.number, "why": "done"})
        hashes = sorted({str(d.get("sha256")) for d in ep.done.values()})
        if len(hashes) > 1:
            self.counters.add("hash_mismatch")
        head = ep.done.get(ep.members[0]) or next(iter(ep.done.values()))
        self._publish_manifest("done")
        summary = {
            "job": self.ck.job,
            "final_accuracy": head.get("accuracy", 0.0),
            "test_loss": head.get("test_loss", 0.0),
            "rounds": head.get("rounds", 0),
            "members": ep.members,
            "model_hashes": hashes,
            "identical_models": len(hashes) == 1,
            "epochs": ep.number + 1,
            "reformations": self.epochs,
            "events": self.events,
            "agent_threads": {a: d.get("threads", 0) for a, d in ep.done.items()},
            "machines": {a: self.fleet.machine(a) for a in ep.members},
            "drift": summarise_drift(
                self.drifts, self.spec.resync_every if self.drifts else 0
            ),
            "probe": self.fleet.probes(ep.members),
            "round_estimate_s": self.fleet.round_estimate(ep.members),
            "wall_seconds": wall,
            "checkpoint": str(self.opts.out / "checkpoint.pt"),
            "coordinator_counters": self.counters.snapshot(),
            "agent_counters": {a: d.get("counters", {}) for a, d in ep.done.items()},
            "bytes_received_by_coordinator": self.link.stats.bytes_received,
            "bytes_sent_by_coordinator": self.link.stats.bytes_sent,
            "centre_rounds": self.centre.served if self.centre is not None else 0,
            "lost": sorted(ep.gone),
            "agent_bytes": {  # number(): summed below, where a member's string would raise
                a: {
                    "ring": int(number(d.get("ring_bytes_sent"))),
                    "link": int(number(d.get("link_bytes_sent"))),
                }
                for a, d in ep.done.items()
            },
        }
        if self.ck.params_sha256 not in hashes:
            self.counters.add("checkpoint_not_final")
            log.error("checkpoint of round %d is not the agents' final model", self.ck.round)
        summary["checkpoint_round"] = self.ck.round
        state = self.centre.state if self.centre is not None else None
        summary["degraded"] = self.degrade.times
        if state is not None and self.asynchronous:  # the centre's versions, not agents' cycles
            summary["rounds"] = state.version
            summary["staleness"] = {str(k): v for k, v in sorted(state.staleness.items())}
        if self.opts.export_onnx:
            summary["onnx"] = outputs.export(self.opts.out, self.counters)
        ring = [b["ring"] for b in summary["agent_bytes"].values()]
        summary["bytes_sent_per_agent"] = sum(ring) / max(len(ring), 1)
        n, collective = len(ep.members), self.collectives.current(self.spec)
        summary["layout"] = (
            "async star" if self.asynchronous
            else f"star of {n}" if self.spec.topology == "star"
            else f"{collective} of {n}" if collective != "ring"
            else layout_name(self.spec.topology, n)
        )  # fmt: skip
        summary["collective"] = self.collectives.summary(self.spec, self.rows, self.fleet)
        summary["coordinator_counters"] = self.counters.snapshot()
        rows = [self.rows[r] for r in sorted(self.rows)]
        outputs.write(self.opts.out, self.spec.replace(agents=len(ep.members)), summary, rows)
        return summary

    # -- plumbing -----------------------------------------------------------------

    def _publish_manifest(self, state: str) -> None:
        assert self.ck is not None and self.link is not None
        table = ShardManifest.from_dict(self.ck.shard_manifest).sha256()
        doc = {"job": self.ck.job, "state": state, "round": self.ck.round,
               "members": sorted(self.ck.shards), "model_sha256": self.ck.model_sha256,
               "shard_table_sha256": table}  # fmt: skip
        [frame] = self.codec.encode("manifest", self.ck.job, "*", doc)
        topic, running = topics.manifest(self.ck.job), state == "running"
        self.link.publish(topic, frame, Deadline.after(SEND_S), retain=running)
        if not running:  # a finished job leaves nothing retained on the broker
            self.link.publish(topic, b"", Deadline.after(SEND_S), retain=True)

    def _send(
        self, dst: str, kind: str, doc: dict[str, Any], blob: bytes = b"", *,
        round: int = 0, sign: bool = True,
    ) -> None:  # fmt: skip
        assert self.ck is not None and self.link is not None
        try:
            for frame in self.codec.encode(kind, self.ck.job, dst, doc, blob, round=round,
                                           sign=sign):  # fmt: skip
                self.link.send_to(self.ck.job, dst, frame, Deadline.after(SEND_S))
        except TransportError as exc:
            self.counters.add("send_failed")
            log.warning("could not send %s to %s: %s", kind, dst, exc)

    def _next(self, timeout: float) -> Control | None:
        assert self.link is not None
        if self.link.taken_over:  # another coordinator holds the id: fighting it helps nobody
            raise CoordinatorError(f"one broker runs one coordinator: {self.link.taken_over}")
        try:
            item = self.link.control.get(timeout=timeout)
        except queue.Empty:
            return None
        if item.kind == "hello":
            self._on_hello(item)
        elif item.kind == "member" and item.event is not None and item.event.kind == "joined":
            self.suspects.clear(item.src)  # a new session: alive, whatever was reported
        return item

    def _poll(self, timeout: float) -> None:
        """Take in hellos between segments (membership is read from presence)."""
        item = self._next(timeout)
        while item is not None:
            item = self._next(0.0)

    def _on_hello(self, item: Control) -> None:
        if not item.data:
            self.fleet.hellos.pop(item.src, None)  # an agent that left for good clears it
            return
        msg = ControlCodec(topics.COORDINATOR, counters=self.counters).decode(item.src, item.data)
        if msg is not None and msg.kind != "hello":
            self.counters.add("frame_unexpected")
            log.warning("a %r frame on the hello topic of %r, refused", msg.kind, item.src)
        if msg is None or msg.kind != "hello":
            return
        self.fleet.hellos[item.src] = msg.doc

    def _decode(self, item: Control) -> ControlMessage | None:
        if item.kind not in ("frame", "metrics"):
            return None
        return self.codec.decode(item.src, item.data)  # refusals counted and logged there


def _slug(text: str) -> str:
    keep = "".join(c if c.isalnum() else "-" for c in text.split(":")[0])
    return keep[:24] or "job"

"""One epoch of a job: its segment run, from the manifests to done or a re-formation.

`SegmentRunner` sends each member its manifest (and the checkpoint's model unless
they all hold the start), then reads the control queue until every member said
``bye`` or the ring must re-form: a member lost or back, a nack, no ack or no
progress in time, or ``auto`` re-planning. On the way it records the head's metrics
rows, checks the members' model hashes, and checkpoints the ring's model: its copy
patched by the members (`replica`), or the head's whole upload where the copy has
nothing to patch or disagrees (and an asynchronous job's centre's versions). A ring's
checkpoint of round r is saved once the head's row r is written (`_save_after_row`),
so a coordinator killed in between never resumes past a row it lacks. What
each event means is decided in `coordinator.epoch`; a re-formation halts the
survivors here, and `service.Coordinator` starts the next epoch.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, NamedTuple

import torch

from fedring.build import needs_centre, plan
from fedring.config import JobSpec
from fedring.coordinator import epoch as decide
from fedring.coordinator import outputs
from fedring.coordinator.byes import read_counters
from fedring.coordinator.centre import StarCentre, evaluator
from fedring.coordinator.collectives import CollectivePlans
from fedring.coordinator.degrade import Degrade
from fedring.coordinator.epoch import Epoch
from fedring.coordinator.manifest import segment_docs
from fedring.coordinator.membership import number
from fedring.coordinator.options import Options
from fedring.coordinator.port import ControlPort
from fedring.coordinator.replica import Replica
from fedring.engine.plan import Plan
from fedring.engine.resync import Drift
from fedring.logs_limit import LogLimiter
from fedring.monitor import JobFeed
from fedring.training.models import flat_sha256
from fedring.transport.base import Deadline
from fedring.transport.mqtt import BrokerConfig, Control
from fedring.wire.control import ControlMessage

log = logging.getLogger(__name__)


class _Held(NamedTuple):
    """A checkpoint complete before the head's row of its round (`_save_after_row`)."""

    epoch: int
    round: int
    params: torch.Tensor
    head: str  # who gets the ack


class SegmentRunner(ControlPort):
    """Runs one epoch at a time over the port, recording rows and checkpoints."""

    def __init__(self, spec: JobSpec, cfg: BrokerConfig, opts: Options) -> None:
        super().__init__(cfg)
        self.spec, self.opts = spec, opts
        self.centre: StarCentre | None = None  # a star or async job's centre
        self.plan: Plan | None = None  # computed once: the initial model, the evaluator
        self.hashes: dict[int, dict[str, str]] = {}
        self.mismatched: set[int] = set()  # rounds whose hashes were found to disagree
        self.resynced: set[int] = set()  # rounds that ended with the head's parameters
        self.drifts: list[tuple[str, int, Drift]] = []  # each member's, before a re-sync
        self.last_row: dict[str, Any] = {}
        self.rows: dict[int, dict[str, Any]] = {}  # the head's metrics by round (a redo replaces)
        self.events: list[dict[str, Any]] = []  # wall-clock times of re-formations
        self.t0: float | None = None  # training starts: rows carry "wall_s" since then
        self.start = time.perf_counter()
        self.wall_before = 0.0  # seconds earlier coordinator processes ran this job
        self.degrade = Degrade(spec)  # a ring that keeps breaking goes asynchronous
        self.collectives = CollectivePlans()  # each epoch's collective (`auto`: planned)
        self.replanning = False  # the epoch ends because `auto` re-plans, not a break
        self.replica = Replica()  # the ring's model, patched by its members' checkpoints
        self.held: list[_Held] = []  # checkpoints waiting for their round's row
        self.feed = opts.feed if opts.feed is not None else JobFeed()
        self.feed.counters = self.counters  # the views read the job's own counts
        self.feed.rounds, self.feed.agents = spec.rounds, spec.agents
        self._log = LogLimiter(log, "messages refused by the coordinator")

    def _wall(self) -> float:
        """Seconds the job has run, the coordinator processes before this one included."""
        return self.wall_before + time.perf_counter() - self.start

    # -- one segment --------------------------------------------------------------

    def _run_segment(self, ep: Epoch) -> bool:
        """`_segment`, with a star job's centre serving the epoch's rounds beside it."""
        if self.centre is None or not (needs_centre(self.spec) or self.degrade.active):
            return self._segment(ep)
        evaluate = evaluator(self._plan(), self.spec.seed) if self.asynchronous else None
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

    def _plan(self) -> Plan:
        if self.plan is None:
            self.plan = plan(self.spec)
        return self.plan

    def _params(self) -> torch.Tensor:
        """The model at the checkpoint's round: its parameters, or the plan's initial ones
        for a derived start not yet checkpointed."""
        assert self.ck is not None
        return self.ck.params if self.ck.params is not None else self._plan().initial

    def _drain_centre(self, ep: Epoch) -> bool:
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
            self.feed.round(row)
            if self.opts.on_round is not None:
                self.opts.on_round(rnd - 1, row)
            if params is not None:
                self._save(ep, params, rnd)
            if self.degrade.calm(rnd) and self.centre.state is not None:
                self.centre.state.stop = True  # every agent gets "end" with its next delta

    def _segment(self, ep: Epoch) -> bool:
        """Run the ring of `ep.members` until done (True) or until it must re-form."""
        ck = self.ck
        assert ck is not None
        log.info("epoch %d: ring %s from round %d", ep.number, ep.members, ep.start)
        self.feed.members(ep.members, "star" if needs_centre(self.spec) else
                          "async" if self.asynchronous else "ring")  # fmt: skip
        self.replica.clear()  # the segment's first checkpoint comes whole from the head
        self.held = []  # an earlier epoch's checkpoints whose rows never came: redone
        # rounds after the start are run again (another ring may round differently)
        self.hashes = {r: seen for r, seen in self.hashes.items() if r <= ep.start}
        self.mismatched = {r for r in self.mismatched if r <= ep.start}
        collective = self.collectives.plan(self.spec, ep.number, ep.members, self.fleet,
                                           self._plan().initial.numel(), ep.start)  # fmt: skip
        docs = segment_docs(ck, ep.members, ep.number, ep.start,
                            self.fleet.frame_bytes(ep.members),
                            "async" if self.asynchronous else "ring",
                            self.fleet.mixed(ep.members), collective, ep.held,
                            self.collectives.codec(),
                            self.collectives.step_timeout_s)  # fmt: skip
        # Every manifest before any model (sending each member its manifest and model in
        # turn, a fan-out over Aedes lost a round-0 broadcast). Not enough alone: a fresh
        # job sends no model, and a loaded member may subscribe late, so a broadcast
        # collective's members also wait for the go, sent once every member acked; a
        # member acks once the broker confirmed its subscription (`ep.barrier`).
        ep.barrier = any(doc.get("barrier") for doc in docs.values())
        for agent, doc in docs.items():
            self._send(agent, "manifest", doc, sign=False)
        if ck.params is not None and not ep.held:
            blob = ck.params.numpy().astype("<f4").tobytes()
            for agent in docs:
                self._send(agent, "model", {"round": ck.round}, blob, round=ck.round)
        stall = self._stall(ep.members)
        acks_by = Deadline.after(self.opts.ack_timeout_s)
        progress = Deadline.after(stall)
        while True:
            if self.centre is not None:
                self.centre.check()  # a centre that failed by itself ends the job with its error
            if self.asynchronous and self._drain_centre(ep):
                progress = Deadline.after(stall)
            if ep.finished:
                return True
            if acks_by.expired and (missing := ep.unacked()):  # not O(N) at every message
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

    def _stall(self, members: list[str]) -> float:
        step = max(self.spec.timeout_s, self.collectives.step_timeout_s)
        return self.opts.stall_s or self.fleet.stall(members, step)

    def _on_item(self, ep: Epoch, item: Control) -> tuple[str, bool]:
        """(reason to re-form or "", whether the job moved forward)."""
        assert self.ck is not None
        if item.kind == "member" and item.event is not None:
            who, kind = item.src, item.event.kind
            if who in self.ck.shards and self.centre is not None and self.centre.state is not None:
                self.degrade.moved(self.centre.state.version)  # not calm yet
            verdict = decide.on_member(ep, self.ck.shards, who, kind, self.asynchronous)
            if verdict.lost:
                self.counters.add("agent_lost")
                self.feed.event("lost", f"{who} {kind}")
            return self._take(ep, who, verdict)
        msg = self._decode(item)
        if msg is None or msg.job != self.ck.job:
            return "", False
        epoch = msg.doc.get("epoch")
        if item.kind == "metrics":
            return "", self._on_metrics(ep, msg)
        if epoch != ep.number:
            return "", False  # a late word from an earlier epoch
        if msg.kind == "ack":
            first = msg.src not in ep.acks
            ep.acks.add(msg.src)
            self.fleet.on_ack(msg.src, msg.doc)
            if first and len(ep.acks) >= len(ep.members) and not ep.unacked():
                if self.t0 is None:
                    self.t0 = time.perf_counter()  # every agent holds its shard and model
                if ep.barrier:  # every member hears the broadcasts now: round 0 may go
                    for member in ep.members:
                        self._send(member, "ack", {"epoch": ep.number, "go": True})
        elif msg.kind == "nack":
            self.counters.add("agent_nack")
            self._stopped(ep, msg)
            verdict = decide.on_nack(msg.src, str(msg.doc.get("why", "")), self.asynchronous)
            return self._take(ep, msg.src, verdict)
        elif msg.kind == "model":
            self._on_model(ep, msg)
            return "", True
        elif msg.kind == "bye":
            ep.done[msg.src] = self._bye(msg)
            return "", True
        elif msg.kind != "metrics":  # (a metrics row belongs on the metrics topic: ignored)
            self.counters.add("control_unknown_kind")
            self._log.warning(msg.src, "control_unknown_kind", "a %.40r message from %s in "
                              "job %s: not a kind the coordinator reads; ignored", msg.kind,
                              msg.src, msg.job)  # fmt: skip
        return "", False

    def _stopped(self, ep: Epoch, msg: ControlMessage) -> None:
        """A member's nack: its segment ended (or never began), at the round it names."""
        self._note_nack(msg)
        ep.stopped.add(msg.src)
        committed, sha = msg.doc.get("committed"), msg.doc.get("sha256")
        if type(committed) is int and isinstance(sha, str):
            ep.halted[msg.src] = (committed, sha)  # the round it holds

    def _bye(self, msg: ControlMessage) -> dict[str, Any]:
        """A member's bye with its counters checked (`byes.read_counters`): refused ones
        are left out of the summary, counted and logged."""
        read = read_counters(msg.doc)
        if read.refused:
            self.counters.add("bad_agent_counters")
            self._log.warning(msg.src, "bad_agent_counters", "the bye of %s: %s; its "
                              "counters are left out", msg.src, read.refused)  # fmt: skip
        return {**msg.doc, "counters": read.counters}

    def _take(self, ep: Epoch, who: str, verdict: decide.Verdict) -> tuple[str, bool]:
        """(the reason to re-form, False); an asynchronous job that goes on without
        `who` says so, once."""
        if verdict.drop and ep.went(who):
            log.warning("%s %s; the asynchronous job goes on without it", who, verdict.drop)
            self.feed.event("dropped", f"{who} {verdict.drop}; went on without it")
            self.events.append({"t": time.time(), "epoch": ep.number,
                                "why": f"{who} {verdict.drop}; went on without it"})  # fmt: skip
        return verdict.reform, False

    def _on_metrics(self, ep: Epoch, msg: ControlMessage) -> bool:
        row = msg.doc
        rnd = row.get("round")
        if type(rnd) is not int:
            self.counters.add("bad_metrics")
            self._log.warning(msg.src, "bad_metrics", "a metrics row from %s with round=%.40r "
                              "(not an integer): ignored", msg.src, rnd)  # fmt: skip
            return False
        if row.get("resynced") is True:
            self.resynced.add(rnd)
            drift = Drift(number(row.get("drift_max_abs")), number(row.get("drift_l2")))
            self.drifts.append((msg.src, rnd, drift))
        sha = row.get("sha256")
        if isinstance(sha, str):
            seen = self.hashes.setdefault(rnd, {})
            seen[msg.src] = sha
            if (self.spec.sync == "sync" and rnd not in self.mismatched
                    and not decide.hashes_agree(seen, rnd in self.resynced, self.fleet.machine)):
                self.mismatched.add(rnd)  # once a round, not once a member's row after it
                self.counters.add("hash_mismatch")
                log.error("round %d: model hashes disagree: %s", rnd, seen)
        if msg.src == ep.members[0]:
            if self.t0 is not None:
                row = {**row, "wall_s": round(time.perf_counter() - self.t0, 4)}
            self.last_row = row
            row = {**self.collectives.tag(row), "dense_bytes": self._dense_sent(ep, rnd)}
            self.collectives.observe(self.spec, rnd, row)
            self.rows[rnd] = {k: v for k, v in row.items() if k not in ("sha256", "machine")}
            outputs.append_row(self.opts.out, self.rows[rnd])  # a crash keeps the history
            self.feed.round(self.rows[rnd])
            if self.opts.on_round is not None:
                self.opts.on_round(rnd - 1, row)
            for held in [h for h in self.held if h.epoch == ep.number and h.round <= rnd]:
                self.held.remove(held)
                self._save_and_ack(ep, held)
            return True
        return False

    def _on_model(self, ep: Epoch, msg: ControlMessage) -> None:
        """A member's patch of its slice (`replica`), or the head's whole model."""
        if "from" not in msg.doc:
            if msg.src == ep.members[0]:
                self._checkpoint(ep, msg)
            return
        taken = self.replica.take(msg, ep.members[1:] or ep.members[:1])
        if taken is None:
            return
        if taken.params is not None:
            self._save_after_row(ep, _Held(ep.number, taken.round, taken.params, ep.members[0]))
            return
        self.counters.add("checkpoint_patch_refused")
        self._log.warning(msg.src, "checkpoint_patch_refused", "checkpoint of round %d: %s; "
                          "asking %s for its whole model", taken.round, taken.why,
                          ep.members[0])  # fmt: skip
        self._send(ep.members[0], "ack",
                   {"epoch": ep.number, "round": taken.round, "send": "model"})  # fmt: skip

    def _dense_sent(self, ep: Epoch, rnd: int) -> int:
        """Bytes a member would have sent by round `rnd` had every round been a dense fp32
        exchange of the whole model (in a ring 2 (N - 1) / N of it, to a centre all of it):
        the baseline the dashboard draws beside the head's `bytes_sent`."""
        whole, n = 4 * self._plan().initial.numel(), len(ep.members)
        step = whole if needs_centre(self.spec) else 2 * (n - 1) * whole // max(n, 1)
        before = self.rows.get(rnd - 1, {}).get("dense_bytes")
        return (before if isinstance(before, int) else (rnd - 1) * step) + step

    def _checkpoint(self, ep: Epoch, msg: ControlMessage) -> None:
        assert self.ck is not None
        numel = len(msg.blob) // 4
        if len(msg.blob) != numel * 4 or numel == 0:
            self.counters.add("frame_shape_mismatch")
            self._log.warning(msg.src, "frame_shape_mismatch", "checkpoint of round %d from %s: "
                              "%d bytes, not whole float32 values: not saved", msg.round,
                              msg.src, len(msg.blob))  # fmt: skip
            return
        params = torch.frombuffer(bytearray(msg.blob), dtype=torch.float32).clone()
        if flat_sha256(params) != msg.doc.get("sha256"):
            self.counters.add("checkpoint_bad_sha256")
            self._log.warning(msg.src, "checkpoint_bad_sha256", "checkpoint of round %d from "
                              "%s: sha256 mismatch: not saved", msg.round, msg.src)  # fmt: skip
            return
        self.replica.reset(params, msg.round)  # the members' next patches apply to it
        # The head waits for this before the next checkpoint round's rounds: agents
        # never get more than two checkpoints ahead of what a restarted coordinator
        # can resume from (`edge_agent.running.Running.gate`).
        self._save_after_row(ep, _Held(ep.number, msg.round, params, msg.src))

    def _save_after_row(self, ep: Epoch, held: _Held) -> None:
        """Save the checkpoint (and ack it) now if the head's row of its round is
        written, else when it is: the members' patches can complete a checkpoint before
        the head's row arrives, and a coordinator killed in between would resume past a
        round with no row (CI saw one). The head sends row r before it waits for the ack
        of r, so the wait ends; a checkpoint whose row never comes (the head was lost)
        is dropped with its epoch, and its rounds are redone."""
        row = self.rows.get(held.round)
        if held.round <= ep.start or (row is not None
                                      and row.get("epoch", ep.number) == ep.number):  # fmt: skip
            self._save_and_ack(ep, held)
        else:
            self.held.append(held)

    def _save_and_ack(self, ep: Epoch, held: _Held) -> None:
        self._save(ep, held.params, held.round)
        self._send(held.head, "ack", {"epoch": ep.number, "round": held.round})

    def _save(self, ep: Epoch, params: torch.Tensor, rnd: int) -> None:
        """Checkpoint the model at the start of round `rnd`, atomically."""
        assert self.ck is not None
        self.ck.params, self.ck.round, self.ck.epoch = params, rnd, ep.number
        self.ck.events, self.ck.wall_s = self.events, self._wall()
        started = time.perf_counter()
        self.ck.save(self.opts.out)
        self.collectives.saves.append(time.perf_counter() - started)  # the head waits on it

    def _reform(self, ep: Epoch, why: str) -> bool:
        """Halt the survivors and wait until they stopped; the caller starts a new epoch,
        unless every member's bye came meanwhile (True: they had all run to the end)."""
        log.warning("epoch %d ends: %s; re-forming from round %d", ep.number, why,
                    self.ck.round if self.ck else 0)  # fmt: skip
        assert self.link is not None and self.ck is not None
        self.events.append({"t": time.time(), "epoch": ep.number, "why": why})
        self.feed.event("re-formed", why)
        for agent in ep.members:
            if agent in self.link.peers():
                self._send(agent, "bye", {"epoch": ep.number, "why": "halt"})
        # A member that nacked has ended its segment (or never began it): it answers no
        # halt, and waiting for it would cost every such re-formation `halt_timeout_s`.
        waiting = {a for a in ep.members if a in self.link.peers()} - set(ep.done) - ep.stopped
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
            if msg.kind == "model" and this_epoch:
                self._on_model(ep, msg)
            if msg.kind == "nack" and this_epoch:
                waiting.discard(msg.src)
                self._stopped(ep, msg)  # a refusal while the others halt counts too
            elif msg.kind == "bye" and this_epoch:  # it had ended the job's last round
                waiting.discard(msg.src)  # before the halt reached it
                ep.done[msg.src] = self._bye(msg)
                committed, sha = msg.doc.get("rounds"), msg.doc.get("sha256")
                if type(committed) is int and isinstance(sha, str):
                    ep.halted[msg.src] = (committed, sha)  # the round it holds
        if ep.finished:  # all ran ahead to the end (CI: a re-plan went back to round 0)
            log.info("epoch %d: every member had finished the job before the halt", ep.number)
            return True
        return False

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

The coordinator is layered, each layer a module: `port.ControlPort` is its end of
the broker (sends, the control queue, hellos, who is online); `segment.SegmentRunner`
runs one epoch on it (manifests, metrics, checkpoints, halting); `Coordinator` here
runs the job (enrol or resume, the epochs, the summary). Every decision they take --
who forms the next ring, whether an event re-forms it, when an epoch is done, where a
re-plan resumes, whether the ring broke or re-planned -- is a function of plain values
in `epoch`, the ring's degrading to asynchronous in `degrade`, the summary's assembly
in `summary`; the fleet's order and probes are in `membership`, the files in
`outputs` and `checkpoint`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from fedring.build import opens_centre, plan
from fedring.config import JobSpec
from fedring.coordinator import epoch as decide
from fedring.coordinator import outputs
from fedring.coordinator.centre import StarCentre
from fedring.coordinator.checkpoint import Checkpoint
from fedring.coordinator.epoch import HELD_SPREAD, Epoch
from fedring.coordinator.lease import check_broker
from fedring.coordinator.options import Options
from fedring.coordinator.port import CoordinatorError
from fedring.coordinator.segment import SegmentRunner
from fedring.coordinator.summary import Centre, assemble, describe_layout, model_hashes
from fedring.engine.resync import summarise as summarise_drift
from fedring.transport import topics
from fedring.transport.base import Deadline
from fedring.transport.mqtt import BrokerConfig, MqttLink

log = logging.getLogger(__name__)
_Epoch = Epoch  # the name tests of the coordinator's handlers use
__all__ = ["HELD_SPREAD", "Coordinator", "CoordinatorError", "Options"]
FEED_S = 0.2  # seconds between the dashboard's counts of agents ready while enrolling


class Coordinator(SegmentRunner):
    """One job from enrolment (or a saved checkpoint) to its summary."""

    def __init__(self, spec: JobSpec, cfg: BrokerConfig, opts: Options) -> None:
        super().__init__(spec, cfg, opts)
        self.epochs = 0  # re-formations so far

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
            self.feed.job, self.feed.rounds = ck.job, self.spec.rounds
            self.wall_before = ck.wall_s
            self.rows = outputs.load_rows(self.opts.out, up_to=ck.round, keep=saved is not None)
            self.codec.key = ck.key
            if opens_centre(self.spec):
                self.centre = StarCentre(self.link, ck.job, ck.key, self.counters)
            self._publish_manifest("running")
            members = self._members()
            epoch = ck.epoch + 1 if self.opts.resume else 0
            last: Epoch | None = None
            while True:
                if not members:
                    raise CoordinatorError("no agent holding a shard is online")
                start, held = ck.round, ""
                if self.replanning and last:  # the same ring goes on from where it halted
                    members = decide.same_order(members, last.members)
                    start, held = self._held_round(last, members) or (ck.round, "")
                ep = Epoch(epoch, members, start, held=held)
                self.replanning = False
                done, last = self._run_segment(ep), ep
                ended = decide.outcome(done, self.degrade.returning, self.replanning)
                if ended == "back" and self._back_to_ring(ep):
                    ended = "finish"  # it ended asynchronously after all
                elif ended == "break" and (why := self.degrade.broke(ck.round)):
                    log.warning(why)
                    self.counters.add("degraded_to_async")
                    self.feed.event("degraded", why)
                    self.events.append({"t": time.time(), "epoch": ep.number, "why": why})
                if ended == "finish":
                    summary = self._finish(ep, self._wall())
                    self.feed.finish(ok=True)
                    return summary
                self.epochs += 1
                if self.epochs >= self.opts.max_epochs:
                    raise CoordinatorError(f"gave up after {self.epochs} re-formations")
                epoch += 1
                members = self._members()
                self._check_refusals(members)
        except BaseException:
            self.feed.finish(ok=False)
            raise
        finally:
            if self.centre is not None:
                self.centre.close()
            self.link.close("offline")

    def _enrol_and_plan(self) -> Checkpoint:
        want = self.opts.min_agents or self.spec.agents
        log.info("waiting for %d agents on %s", want, self.cfg.url)
        chosen = self.fleet.order(self._await_agents(want))[: self.spec.agents]
        if self.spec.sample > len(chosen):  # a whole number (a fraction is at most 1)
            why = (f"sample={self.spec.sample:g} asks for more agents a round than the "
                   f"{len(chosen)} enrolled: every round trains all {len(chosen)}")  # fmt: skip
            log.warning(why)
            self.events.append({"t": time.time(), "epoch": 0, "why": why})
        spec = self.spec.replace(agents=len(chosen))
        p = self.plan = plan(spec)
        job = topics.check_id("job", f"{_slug(spec.task or spec.dataset)}-{os.urandom(4).hex()}")
        log.info("job %s: %d agents, ring %s", job, len(chosen), chosen)
        self.feed.job, self.feed.agents = job, len(chosen)
        return Checkpoint(
            job=job, key=os.urandom(32), spec=spec.resolved(),
            shards={a: i for i, a in enumerate(chosen)}, model_sha256=p.model_sha256,
            shard_manifest=p.manifest.to_dict(), epoch=0, round=0,
            params=p.initial if spec.init == "sent" else None,  # sent, not re-derived
            task=p.task_id.to_dict(),
        )  # fmt: skip

    def _await_agents(self, want: int) -> set[str]:
        """Until `want` agents are ready (a hello, and online), within the enrolment
        deadline. `_ready` is a pass over the fleet: it is worked out once there are
        hellos enough (a ready agent has one), not after every batch of hellos (N^2 at
        enrolment, hellos coming one by one), and for the dashboard's count at most
        every `FEED_S`."""
        deadline = Deadline.after(self.opts.enrol_timeout_s)
        shown = -FEED_S
        while True:
            if len(self.fleet.hellos) >= want and len(ready := self._ready()) >= want:
                self.feed.online(len(ready))
                return ready
            if deadline.expired:
                raise CoordinatorError(
                    f"only {len(self._ready())} of {want} agents enrolled within "
                    f"{self.opts.enrol_timeout_s:g} s: {sorted(self._ready())}"
                )
            self._poll(0.2)
            if time.monotonic() - shown >= FEED_S:
                self.feed.online(len(self._ready()))
                shown = time.monotonic()

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
        """Never shrink silently below the minimum because agents refused the job."""
        if why := decide.shortfall(members, self.opts.min_agents or self.spec.agents,
                                   self.refused):  # fmt: skip
            self.counters.add("too_few_after_refusals")
            raise CoordinatorError(why)

    def _back_to_ring(self, ep: Epoch) -> bool:
        """A degraded epoch ended for calm: checkpoint the centre's model and run the
        ring from its version. True if the job is finished after all."""
        assert self.centre is not None and self.centre.state is not None
        state = self.centre.state
        self._save(ep, state.model.clone(), state.version)
        accuracy = self.rows.get(state.version, {}).get("accuracy", 0.0)
        if decide.async_ended(state.version, self.spec.rounds, self.spec.target_accuracy,
                              accuracy):  # fmt: skip
            self.degrade.returning = False  # it ended asynchronously: summarised as such
            return True
        why = self.degrade.back(state.version)
        log.info(why)
        self.counters.add("back_to_ring")
        self.feed.event("back to ring", why)
        self.events.append({"t": time.time(), "epoch": ep.number, "why": why})
        return False

    def _held_round(self, ep: Epoch, members: list[str]) -> tuple[int, str] | None:
        held = decide.held_round(ep, members, HELD_SPREAD)
        if held is not None:
            log.info("epoch %d: every member holds round %d: no roll-back to the checkpoint",
                     ep.number, held[0])  # fmt: skip
        else:
            halted = {a: (r, sha[:12]) for a, (r, sha) in sorted(ep.halted.items())}
            log.warning("epoch %d: no round every member holds (halted at %s; members %s, "
                        "the epoch's %s): back to the checkpoint", ep.number, halted,
                        members, ep.members)  # fmt: skip
        return held

    # -- the end ------------------------------------------------------------------

    def _finish(self, ep: Epoch, wall: float) -> dict[str, Any]:
        assert self.ck is not None and self.link is not None
        for agent in ep.members:
            self._send(agent, "bye", {"epoch": ep.number, "why": "done"})
        hashes = model_hashes(ep)
        if len(hashes) > 1:
            self.counters.add("hash_mismatch")
        self._publish_manifest("done")
        received, sent = self.link.stats.bytes_received, self.link.stats.bytes_sent  # before ONNX
        if self.ck.params_sha256 not in hashes:
            self.counters.add("checkpoint_not_final")
            log.error("checkpoint of round %d is not the agents' final model", self.ck.round)
        onnx = outputs.export(self.opts.out, self.counters) if self.opts.export_onnx else None
        state = self.centre.state if self.centre is not None else None
        n, collective = len(ep.members), self.collectives.current(self.spec)
        summary = assemble(
            job=self.ck.job, ep=ep, reformations=self.epochs, events=self.events,
            fleet=self.fleet, wall_s=wall, checkpoint=str(self.opts.out / "checkpoint.pt"),
            drift=summarise_drift(self.drifts, self.spec.resync_every if self.drifts else 0),
            checkpoint_round=self.ck.round, counters=self.counters.snapshot(),
            bytes_received=received, bytes_sent=sent,
            centre_rounds=self.centre.served if self.centre is not None else 0,
            degraded=self.degrade.times,
            centre=(Centre(state.version, state.staleness)
                    if state is not None and self.asynchronous else None),
            onnx=onnx,
            layout=describe_layout(self.asynchronous, self.spec.topology, collective, n),
            collective=self.collectives.summary(self.spec, self.rows, self.fleet),
        )  # fmt: skip
        summary["codec"] = self.spec.codec_choice()
        rows = [self.rows[r] for r in sorted(self.rows)]
        outputs.write(self.opts.out, self.spec.replace(agents=len(ep.members)), summary, rows)
        return summary


def _slug(text: str) -> str:
    keep = "".join(c if c.isalnum() else "-" for c in text.split(":")[0])
    return keep[:24] or "job"

"""`fedring agent`: the long-running daemon on each board.

It connects to the broker, announces itself (retained ``hello`` with its profile
and a measured step time and bandwidth), and then waits. A ``manifest`` from the
coordinator hands it a job: key, ring members, its shard, the spec. It verifies
its shard and the initial model by sha256, then runs the rounds in a worker
thread while this loop keeps listening, so that a ``bye`` (halt) or the
coordinator's disappearance can stop a segment at once. After each segment it
reports: ``bye`` with its model hash when the job is done, ``nack`` with the last
completed round when the segment was cut short. On SIGTERM it halts, publishes
"offline" and exits 0.

Why one module of about 380 lines: the daemon is one state machine (hello,
manifest, model, segment, halt) whose handlers share the same few fields; a
manifest is read in `manifest`, the running segment's halt and checkpoint gate are
`running.Running`, the training itself is in `worker`, the rounds in the engine.
"""

from __future__ import annotations

import logging
import os
import platform
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

from fedring import __version__
from fedring.build import opens_centre
from fedring.collective.channel import CollectiveError
from fedring.compression.probe import codec_cost
from fedring.config import JobSpec, SpecError
from fedring.counters import Counters
from fedring.edge_agent.checkpoint_stream import CheckpointStream, whole_only
from fedring.edge_agent.host import host_id, usable_cores
from fedring.edge_agent.manifest import collective as _collective
from fedring.edge_agent.manifest import read_segment, ring_view
from fedring.edge_agent.running import Running
from fedring.edge_agent.stage import StageHost
from fedring.edge_agent.worker import JobWorker, Segment
from fedring.engine.attack import Attack
from fedring.engine.gate import CodeRefused
from fedring.firmware_profiles.apply import runtime_rss
from fedring.firmware_profiles.schema import Profile
from fedring.logs_limit import LogLimiter
from fedring.monitor import JobFeed
from fedring.training.datasets import DatasetError
from fedring.training.models import flat_bytes, flat_sha256, pay_process_one_offs
from fedring.training.sharding import ShardError
from fedring.transport import topics
from fedring.transport.base import Deadline, TransportError
from fedring.transport.mqtt import BrokerConfig, Control, MqttEndpoint, MqttLink
from fedring.transport.mqtt_presence import resident_bytes
from fedring.wire.control import ControlCodec, ControlMessage
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import decode_frame

log = logging.getLogger(__name__)
SEND_S = 10.0
GO_S = 180.0  # a broadcast segment's wait for the go (a halt or the coordinator's loss ends it)
# For tests and emulation only: the architecture this agent announces (default
# `platform.machine()`), and noise of this size added to its parameters before
# every round, a stand-in for another CPU's rounding (`engine.resync`).
MACHINE_ENV, DRIFT_ENV = "FEDRING_MACHINE", "FEDRING_INJECT_DRIFT"
_Running = Running  # the names tests use
__all__ = ["AgentDaemon", "_collective", "ring_view"]


class AgentDaemon:
    def __init__(
        self,
        cfg: BrokerConfig,
        me: str,
        *,
        data_dir: Path | None = None,
        profile: dict[str, Any] | None = None,
        threads: int = 1,
        budget: Profile | None = None,  # the board's profile: refuse jobs that would not fit
        allowed_modules: tuple[str, ...] = (),  # MODULE:ATTR tasks this agent may import
        attack: Attack | None = None,  # tests only: this agent poisons every job it joins
    ) -> None:
        self.cfg, self.me = cfg, topics.check_id("--id", me)
        self.data_dir = data_dir
        self.profile = profile or {"name": "generic", "machine": platform.machine()}
        self.threads = threads
        self.budget = budget
        self.allowed_modules = allowed_modules
        self.attack = attack
        self.counters = Counters()
        self._log = LogLimiter(log, f"control messages dropped by {self.me}")
        self.codec = ControlCodec(me, counters=self.counters)
        self.feed = JobFeed(counters=self.counters)  # what `--metrics-port` serves
        self.stop = threading.Event()
        self.link: MqttLink | None = None
        self.worker: JobWorker | None = None
        self.endpoint: MqttEndpoint | None = None  # the worker's job: its ring bytes, all epochs
        self.centre: MqttEndpoint | None = None  # a star job's exchanges with the coordinator
        self.link_bytes_at_job = 0  # everything this agent published since the job began
        self.checkpoint_bytes = 0  # "model" frames (dense uploads and patches), every job
        self.checkpoint_bytes_at_job = 0
        self.running: Running | None = None
        self.counters_at_job: dict[str, int] = {}
        self.awaiting: Segment | None = None  # manifest received, checkpoint model not yet
        self.jobs_done = 0
        self.started = time.time()  # announced in the hello (`fedring fleet`'s uptime)
        self.hello_doc: dict[str, Any] = {}  # the first hello's, measured once
        self.machine = os.environ.get(MACHINE_ENV) or platform.machine()
        self.inject_drift = _env_float(DRIFT_ENV)
        self.stages = StageHost(me, self.codec, self.counters, self._send, data_dir=data_dir,
                                budget=budget, allowed_modules=allowed_modules)  # pipeline jobs

    # -- lifecycle --------------------------------------------------------------

    def run(self) -> int:
        torch.set_num_threads(self.threads)
        # The coordinator's presence, and that of the peers of our job (`_watch`) alone:
        # every agent's would be N² messages as a fleet enrols (issue 29).
        self.link = MqttLink(self.cfg, self.me, counters=self.counters,
                             statuses="peers").connect()  # fmt: skip
        self._hello()
        if self.attack is not None:
            log.warning("this agent ATTACKS: %s in every ring, star and async job it joins "
                        "(a test harness for robust aggregation; pipeline stages are not "
                        "attacked; counted as attack_updates)", self.attack)  # fmt: skip
        log.info("agent %s ready on %s", self.me, self.cfg.url)
        while not self.stop.is_set() and not self.link.taken_over:
            try:
                item = self.link.control.get(timeout=0.2)
            except queue.Empty:
                continue
            self._take(item)
        self._halt("shutting down")
        self.stages.halt("shutting down")
        self._join()
        self.stages.join()
        if self.link.taken_over:  # another process is this agent: leave its presence alone
            log.error("agent %s stopped: %s", self.me, self.link.taken_over)
            return 1
        self.link.publish(topics.hello(self.me), b"", Deadline.after(2.0), retain=True)
        self.link.close("offline")
        log.info("agent %s stopped; counters %s", self.me, self.counters.snapshot())
        return 0

    def _hello(self, job: str = "") -> None:
        """Announce this board (retained): what the coordinator orders rings by, and what
        `fedring fleet` shows (versions, memory, start time, the job it is in). The probes
        run once; a change of job re-sends the same hello with the new ``job``."""
        assert self.link is not None
        if not self.hello_doc:
            pay_process_one_offs()  # not in the first job's first round (`torch._dynamo`)
            encode_s, decode_s = codec_cost()  # the collective's cost model (`auto`)
            self.hello_doc = {
                "id": self.me, "session": self.link.session, "profile": self.profile,
                "step_s": _step_time(), **self.link.probe_link(),
                "encode_s": list(encode_s), "decode_s": list(decode_s),
                "threads": self.threads, "machine": self.machine,
                "host": host_id(), "cores": usable_cores(),  # members sharing a CPU
                "fedring": __version__, "torch": torch.__version__,
                "python": platform.python_version(), "started": self.started,
                "mem_total": _physical_memory(),
            }  # fmt: skip
        doc = {**self.hello_doc, "job": job, "rss": resident_bytes()}
        [frame] = self.codec.encode("hello", "-", topics.COORDINATOR, doc, sign=False)
        self.link.publish(topics.hello(self.me), frame, Deadline.after(SEND_S), retain=True)

    def _announce(self, job: str) -> None:
        """Re-send the hello naming `job` ("" none); a failure is counted, not fatal."""
        try:
            self._hello(job)
        except TransportError as exc:
            self.counters.add("send_failed")
            log.warning("%s could not re-send its hello: %s", self.me, exc)

    # -- control messages -------------------------------------------------------

    def _take(self, item: Control) -> None:
        """Handle one control item; whatever it is, the agent goes on."""
        try:
            self._handle(item)
        except FrameError as exc:
            self.counters.add(f"frame_{exc.reason.value}")
            self._log.warning(item.src, exc.reason.value, "%s refused a control message "
                              "from %s: %s", self.me, item.src, exc)  # fmt: skip
        except Exception as exc:  # a message no check foresaw must not end the agent
            self.counters.add("control_error")
            self._log.exception(item.src, type(exc).__name__, "%s: error handling a control "
                                "message from %s", self.me, item.src)  # fmt: skip

    def _handle(self, item: Control) -> None:
        if item.kind == "member" and item.src == topics.COORDINATOR and item.event is not None:
            if item.event.kind in ("lost", "left"):
                self._halt(f"coordinator {item.event.kind}")
                self.stages.halt(f"coordinator {item.event.kind}")
            return
        if item.kind != "frame":
            return
        if self.codec.key is None and _sealed(item.data):
            # Queued by the broker for an earlier process of ours (our session outlives a
            # restart): sealed with a job key this process never had. Not an attack.
            self.counters.add("frame_before_manifest")
            self._log.info(item.src, "frame_before_manifest", "%s dropped a sealed frame of "
                           "job %r sent before it started", self.me, item.job)  # fmt: skip
            return
        msg = self.codec.decode(item.src, item.data)
        if msg is None or (self.link is not None and self.stages.handle(msg, self.link)):
            return
        if msg.kind == "manifest":
            self._on_manifest(msg)
        elif msg.kind == "model":
            self._on_model(msg)
        elif msg.kind == "ack":
            run = self.running
            if run is not None and msg.doc.get("epoch") == run.seg.epoch:
                if msg.doc.get("go") is True:  # the start barrier: every member acked
                    run.go.set()
                    return
                rnd = msg.doc.get("round", 0)
                if isinstance(rnd, bool) or not isinstance(rnd, int):
                    raise FrameError(FrameReason.MALFORMED, f"ack: round={rnd!r}, not an integer")
                if msg.doc.get("send") == "model":  # its copy is off: the head's whole model
                    run.want(rnd)
                else:
                    run.ack(rnd)
        elif msg.kind == "bye":
            epoch = msg.doc.get("epoch")
            why = msg.doc.get("why", "")
            self._halt(f"coordinator said {why!r} (epoch {epoch})")
            if why == "done":
                self._join()
                self._leave_job()
                self._watch([])
                self.worker, self.awaiting = None, None
                self.feed.finish(ok=True)
                self.jobs_done += 1
                self._announce("")  # in no job now
        else:
            self.counters.add("control_unknown_kind")
            self._log.warning(msg.src, "control_unknown_kind", "%s: a %.40r message from %s "
                              "in job %s: not a kind an agent reads; ignored", self.me,
                              msg.kind, msg.src, msg.job)  # fmt: skip

    def _on_manifest(self, msg: ControlMessage) -> None:
        doc = msg.doc
        self._halt("a new manifest arrived")
        self._join()
        try:
            self.codec.key = bytes.fromhex(str(doc["key"]))  # so that a refusal is signed
            seg = read_segment(doc, self.me)
            self._watch(seg.members)  # this epoch's peers: a dead one is seen at once
            if self.worker is None or self.worker.job != seg.job:
                self._leave_job()  # a new job: the old one's frames are flood from now on
                assert self.link is not None
                # The baseline is the moment the link joined: set-up-time drops are this job's.
                self.counters_at_job = self.link.counters_since(seg.job) or self.counters.snapshot()
                spec = JobSpec.from_mapping(doc["spec"])
                self.worker = JobWorker(
                    self.me, seg.job, spec, int(doc["shard"]), doc["shard_entry"],
                    str(doc["model_sha256"]), self.data_dir, self.budget,
                    task=doc.get("task"), allowed_modules=self.allowed_modules,
                    runtime=runtime_rss,  # the budget counts the process as it is
                )  # fmt: skip
                self.worker.drift = self.inject_drift
                self.worker.attack = self.attack
                assert self.link is not None
                self.endpoint = self.link.endpoint(seg.job)
                if self.centre is not None:
                    self.centre.close()
                self.centre = (
                    self.link.endpoint(topics.star(seg.job), private=True)
                    if opens_centre(spec) else None
                )  # fmt: skip
                self.link_bytes_at_job = self.link.stats.bytes_sent
                self.checkpoint_bytes_at_job = self.checkpoint_bytes
                self._announce(seg.job)
        except (KeyError, TypeError, ValueError, SpecError, ShardError, DatasetError) as exc:
            self.counters.add("job_refused")
            if isinstance(exc, CodeRefused):  # code or a path this agent does not allow
                self.counters.add("code_refused")
            log.error("%s refused the job: %s", self.me, exc)
            self._watch([])  # in no job now: its peers' presence is not ours to hear
            self._send(msg.job, "nack", {"epoch": doc.get("epoch"), "why": f"refused: {exc}"})
            return
        if self.worker.restore(seg.start_round, whole=seg.held) and (
            not seg.params_sha256 or self.worker.state_sha256(seg.start_round) == seg.params_sha256
        ):
            self._start(seg)
        else:
            self.awaiting = seg  # the coordinator sends the checkpoint's parameters next

    def _on_model(self, msg: ControlMessage) -> None:
        seg, worker = self.awaiting, self.worker
        if seg is None and self.running is not None and (
            msg.job, msg.round) == (self.running.seg.job, self.running.seg.start_round):
            return  # this agent resumed from its own snapshot of that round: not needed
        if seg is None or worker is None or msg.job != seg.job or msg.round != seg.start_round:
            self.counters.add("model_unexpected")
            waiting = f"job {seg.job}, round {seg.start_round}" if seg is not None else "none"
            self._log.warning(msg.src, "model_unexpected", "%s: a model from %s for job %s, "
                              "round %d, not the one it waits for (%s): ignored", self.me,
                              msg.src, msg.job, msg.round, waiting)  # fmt: skip
            return
        numel = worker.numel
        if len(msg.blob) != numel * 4:
            raise FrameError(
                FrameReason.SHAPE_MISMATCH,
                f"model of {len(msg.blob)} bytes for {numel} parameters",
            )
        params = torch.frombuffer(bytearray(msg.blob), dtype=torch.float32)
        if seg.params_sha256 and flat_sha256(params) != seg.params_sha256:
            self.counters.add("model_bad_sha256")
            log.error("%s: checkpoint model does not match the manifest's sha256", self.me)
            return
        worker.load(seg.start_round, params)
        self.awaiting = None
        self._start(seg)

    # -- segments ---------------------------------------------------------------

    def _start(self, seg: Segment) -> None:
        assert self.link is not None and self.worker is not None and self.endpoint is not None
        worker, link, endpoint, centre = self.worker, self.link, self.endpoint, self.centre
        checkpoint_at_job = self.checkpoint_bytes_at_job
        run = Running(seg, threading.Thread(), acked=seg.start_round)
        halt = run.halt
        patience = 3 * worker.spec.timeout_s
        every = worker.spec.checkpoint_every
        head = self.me == seg.head and not seg.asynchronous  # async: the centre's model
        stream = CheckpointStream(self.me, seg.members, worker.numel,
                                  dense=whole_only(worker.spec.aggregation, seg.mixed))
        uploaded = [seg.start_round]

        def upload(r: int) -> None:
            """Send the parameters at the start of round r for the checkpoint."""
            params = worker.params_at(r)
            if params is None:  # past the kept states: the coordinator's wait re-forms
                log.warning("%s: asked for the model of round %d, no longer held", self.me, r)
                return
            doc = {"round": r, "sha256": flat_sha256(params), "epoch": seg.epoch}
            self._send(seg.job, "model", doc, flat_bytes(params), round=r)

        def checkpoint(r: int) -> None:
            """The state at the start of round r: the head's dense upload where due,
            a member's patch of its slice (`checkpoint_stream`)."""
            if head and stream.dense_due():
                upload(r)
            if not seg.asynchronous and (patch := stream.checkpoint(r, worker.params, seg.epoch)):
                self._send(seg.job, "model", patch[0], patch[1], round=r)
            uploaded[0] = r

        gate = (lambda r: run.gate(r, every, patience, upload)) if head else None

        def on_round(r: int, row: dict[str, Any]) -> None:
            self.feed.round(row)
            if (r + 1) % every == 0:
                checkpoint(r + 1)
            if self.me == seg.head or "accuracy" in row or "resynced" in row:
                metrics = {k: v for k, v in row.items() if isinstance(v, int | float | str)}
                if "accuracy" in row or "resynced" in row:
                    metrics["sha256"] = flat_sha256(worker.params)
                metrics["machine"] = self.machine
                metrics["epoch"] = seg.epoch
                [frame] = self.codec.encode("metrics", seg.job, topics.COORDINATOR, metrics)
                link.publish(topics.metrics(seg.job, self.me), frame, Deadline.after(SEND_S))

        def body() -> None:
            try:
                if seg.barrier:  # every member subscribed to the broadcasts: round 0 may go
                    run.start(GO_S)
                result = worker.run(seg, endpoint, self.codec.key or b"",
                                    self.counters, halt, on_round, gate, centre)  # fmt: skip
                if uploaded[0] != worker.committed:
                    checkpoint(worker.committed)  # the final state, before the bye
                if head:  # saved, patched or (asked for) whole, before the bye
                    run.gate(worker.committed, 1, patience, upload, ahead=0)
                result["epoch"] = seg.epoch
                star = centre.stats.bytes_sent if centre is not None else 0
                result["ring_bytes_sent"] = endpoint.stats.bytes_sent + star
                # Up to here: the bye itself and what follows are not counted.
                result["link_bytes_sent"] = link.stats.bytes_sent - self.link_bytes_at_job
                result["checkpoint_bytes_sent"] = self.checkpoint_bytes - checkpoint_at_job
                result["counters"] = self._job_counters()
                result["threads"] = threading.active_count()
                self._send(seg.job, "bye", result)
            except CollectiveError as exc:
                log.warning("%s: segment %d stopped at round %d: %s",
                            self.me, seg.epoch, worker.committed, exc)  # fmt: skip
                self._send(seg.job, "nack", {
                    "epoch": seg.epoch, "committed": worker.committed, "why": str(exc),
                    "lost": getattr(exc, "peer", ""),  # a suspect until the watch decides
                    "sha256": worker.state_sha256(worker.committed) or "",  # held: resumable
                })  # fmt: skip
            except Exception as exc:  # a bug or a bad job: report it, keep the daemon up
                log.exception("%s: segment %d failed", self.me, seg.epoch)
                self._send(seg.job, "nack", {"epoch": seg.epoch, "committed": worker.committed,
                                             "why": f"error: {exc}"})  # fmt: skip

        feed = self.feed  # the job's rows come in `on_round`
        feed.job, feed.rounds, feed.agents = seg.job, worker.spec.rounds, len(seg.members)
        feed.members(seg.members, "async" if seg.asynchronous else "ring")
        run.thread = threading.Thread(target=body, name=f"{self.me}-e{seg.epoch}", daemon=True)
        self.running = run
        if seg.barrier and not link.hears(seg.job, Deadline.after(SEND_S)):
            self.counters.add("broadcast_subscribe_slow")  # acked anyway: the ring may re-form
            log.warning("%s: no SUBACK for job %s's broadcasts in %g s", self.me, seg.job,
                        SEND_S)  # fmt: skip
        self._send(seg.job, "ack", {"epoch": seg.epoch, "start_round": seg.start_round,
                                    "step_s": worker.step_s, "numel": worker.numel})  # fmt: skip
        longer = f", steps wait up to {seg.timeout_s:g} s" if seg.timeout_s else ""
        log.info("%s: epoch %d, rank %d of %d, from round %d%s", self.me, seg.epoch,
                 seg.members.index(self.me), len(seg.members), seg.start_round,
                 longer)  # fmt: skip
        run.thread.start()

    def _watch(self, members: list[str]) -> None:
        """Hear the presence of these members (the manifest's ring view: its ``~i``
        placeholders are members we never exchange with) and the coordinator's."""
        if self.link is not None:
            self.link.watch_peers(m for m in members if not m.startswith("~"))

    def _leave_job(self) -> None:
        """Unsubscribe from the current job's topics (its star's too): an agent holds
        only the frames of the job it is in."""
        worker, link = self.worker, self.link
        if worker is not None and link is not None:
            link.leave(worker.job)
            link.leave(topics.star(worker.job))

    def _job_counters(self) -> dict[str, int]:
        """What the counters gained since this job's first manifest (non-zero only)."""
        before = self.counters_at_job
        now = self.counters.snapshot()
        return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}

    def _halt(self, why: str) -> None:
        run = self.running
        if run is not None and run.thread.is_alive() and not run.halt.is_set():
            log.info("%s: halting epoch %d: %s", self.me, run.seg.epoch, why)
            run.halt.set()
            run.ack(-1)  # wake the gate
            if self.link is not None:
                self.link.interrupt(run.seg.channel_job)

    def _join(self) -> None:
        run = self.running
        if run is not None:
            run.thread.join()
            self.running = None

    def _send(
        self, job: str, kind: str, doc: dict[str, Any], blob: bytes = b"", *, round: int = 0
    ) -> None:
        if self.link is None:
            return
        try:
            for frame in self.codec.encode(kind, job, topics.COORDINATOR, doc, blob, round=round):
                self.link.send_to(job, topics.COORDINATOR, frame, Deadline.after(SEND_S))
                if kind == "model":
                    self.checkpoint_bytes += len(frame)  # the split of `link_bytes_sent`
        except TransportError as exc:
            self.counters.add("send_failed")
            log.warning("%s could not send %s to the coordinator: %s", self.me, kind, exc)


def _sealed(data: bytes) -> bool:
    """Whether a control frame is sealed (it does not decode without a key)."""
    try:
        decode_frame(data, None)
    except FrameError as exc:
        return exc.reason is FrameReason.BAD_MAC
    return False


def _env_float(name: str) -> float:
    """A number from the environment (0 when unset); a bad one stops the agent, named."""
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else 0.0
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} must be a number") from None
    if not 0.0 <= value < 1.0:
        raise ValueError(f"environment variable {name}={text!r} must be in [0, 1)")
    return value


def _physical_memory() -> int:
    """The board's memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


def _step_time(n: int = 3) -> float:
    """Seconds for a small fixed training-like workload: the board's relative speed."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for _ in range(n):
        (a @ a).sum()
    return (time.perf_counter() - start) / n

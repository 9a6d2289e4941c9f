"""Protocol agents: fedring's MQTT agent protocol without torch, hundreds to a process.

`fedring coordinator run` cannot tell these agents from real ones at the protocol
level: each has its own connection (`loadgen_mqtt.MqttConn`), retained presence with
a will, beats, the coordinator's and its manifest's peers' statuses heard (issue 29),
a retained hello (`wire.control` frame, its profile and link figures); it
acknowledges its manifest once the checkpoint's model arrived, sends star and
asynchronous updates of the job's size as sealed compact frames (`wire.compact`, a
group-top-k payload of the manifest's numel, G, k and value dtype), runs a ring job's
2(N-1) steps a round with its ring neighbours (`loadgen_ring`: each step's chunk out
to the right, the left's checked in), sends the head's metrics rows, the checkpoint
stream (the head's first dense upload, every other member's patch of its slice) and
a ``bye`` with its model hash. No agent trains: each holds the same parameters,
``params(r)`` = every entry equal to r, so patches are as dense as a trained model's
and every hash agrees.

What they do not do (see docs/benchmarks.md, "Fleet scale"): a torus, fanout or hub
ring, or a ring codec other than group-top-k ``bounded`` at a fixed k (refused with a
``nack``, as a daemon refuses a job it cannot run), the link probe (the hello
announces `LoadSettings.link_bps`), consensus supports (robust rules), re-connecting,
and decoding the centre's replies (they are checked and reassembled as frames, the
payload is taken as opaque bytes).

`loadgen_fleet.LoadFleet` runs N of them in one event loop; `loadgen_run` runs one
scenario against Mosquitto and a real coordinator. Why one module of about 500 lines:
as the daemon's, an agent is one state machine (hello, manifest, model, rounds, bye)
whose handlers share a few fields; the payloads it sends are in `loadgen_payloads`,
a ring's steps in `loadgen_ring`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fedring.engine.participation import sampled  # torch-free: the agents' own rule
from fedring.lab.loadgen_mqtt import MqttConn
from fedring.lab.loadgen_payloads import Params, star_payload
from fedring.lab.loadgen_ring import RingPeer, RingShape
from fedring.transport import topics
from fedring.wire.chunks import Reassembler, split_payload
from fedring.wire.compact import decode_compact, encode_compact
from fedring.wire.control import ControlCodec, ControlMessage
from fedring.wire.errors import FrameError
from fedring.wire.frame import Frame, FrameLimits
from fedring.wire.patch import encode_patch

log = logging.getLogger(__name__)
COORD = topics.COORDINATOR
PRESENCE = ("peers", "all", "none")  # `LoadSettings.presence`
Exchange = Callable[[int], Awaitable[dict[str, Any]]]  # a round's; its extra metrics


@dataclass(frozen=True)
class LoadSettings:
    host: str
    port: int
    prefix: str = "load"  # agent ids: PREFIX-0000 ...
    keepalive: int = 5  # seconds; beats go out 3 times a keep-alive, as a real link's
    # Whose status an agent subscribes to: "peers", the coordinator's and its manifest's
    # peers', as a real agent (`MqttLink.watch_peers`); "all", every agent's, as real
    # agents did before issue 29 (N² messages at enrolment); "none".
    presence: str = "peers"
    link_bps: float = 50e6  # announced in the hello (real agents measure theirs)
    machine: str = "x86_64"
    connect_parallel: int = 64  # connections opened at once

    def __post_init__(self) -> None:
        if self.presence not in PRESENCE:
            raise ValueError(f"presence={self.presence!r} must be one of {PRESENCE}")


@dataclass
class AgentTimes:
    hello: float = 0.0  # monotonic time of the first hello
    manifest: float = 0.0  # of the first manifest received
    model: float = 0.0  # of the first checkpoint's model received
    ack: float = 0.0  # of the ack of the first manifest
    done: float = 0.0  # of the bye
    rounds: int = 0
    manifests: int = 0
    refused: int = 0  # frames that did not decode
    statuses: int = 0  # other agents' statuses the broker handed us (issue 29)
    refused_jobs: int = 0  # manifests answered "refused: ..."


@dataclass
class Segment:
    """What a manifest asked for, and the segment's progress."""

    job: str
    epoch: int
    key: bytes
    rank: int
    world: int
    start: int
    spec: dict[str, Any]
    asynchronous: bool
    limits: FrameLimits
    acked: int = 0
    # (round, phase, payload body): the centre's replies, checked and joined
    replies: asyncio.Queue[tuple[int, str, bytes]] = field(default_factory=asyncio.Queue)
    acks: asyncio.Event = field(default_factory=asyncio.Event)
    parts: Reassembler = field(default_factory=Reassembler)
    task: asyncio.Task[None] | None = None
    committed: int = 0
    ring: RingPeer | None = None  # a ring job's exchanges with its neighbours

    @property
    def channel_job(self) -> str:
        return f"{self.job}.e{self.epoch}"

    @property
    def head(self) -> bool:
        return self.rank == 0


class ProtocolAgent:
    """One agent of the fleet: its connection, its hello, its manifests and rounds."""

    def __init__(self, me: str, settings: LoadSettings, params: Params) -> None:
        self.me, self.settings, self.params = me, settings, params
        self.session = os.urandom(6).hex()
        self.codec = ControlCodec(me)
        self.conn = MqttConn(f"fedring-{me}", self._on_message)
        self.times = AgentTimes()
        self.seg: Segment | None = None
        self.pending: Segment | None = None  # manifest in, the checkpoint's model not yet
        self.finished = asyncio.Event()
        self._seq = 0
        self._beats: asyncio.Task[None] | None = None
        self._hello_doc: dict[str, Any] = {}
        self._watched: set[str] = set()  # peers whose status we subscribe to ("peers")

    # -- presence ---------------------------------------------------------------------

    def status(self, state: str) -> bytes:
        return json.dumps({"state": state, "session": self.session, "ts": time.time(),
                           "keepalive": self.settings.keepalive}).encode()  # fmt: skip

    async def start(self) -> None:
        s, me = self.settings, self.me
        will = (topics.status(me), self.status("lost"), 1, True)
        await self.conn.open(s.host, s.port, s.keepalive, will=will)
        subs = [(topics.my_inboxes(me), 1), (topics.probe(me), 1)]
        if s.presence == "all":
            subs.append((f"{topics.ROOT}/agents/+/status", 1))
        elif s.presence == "peers":  # our own (a link reads it: issue 27), the coordinator's
            subs += [(topics.status(me), 1), (topics.status(COORD), 1)]
        self.conn.subscribe(subs)
        self.conn.publish(topics.status(me), self.status("online"), retain=True)
        self.times.hello = time.monotonic()
        self.hello("")
        self._beats = asyncio.create_task(self._beat())

    def watch(self, peers: set[str]) -> None:
        """As `MqttLink.watch_peers`: subscribe to the new peers' statuses, drop the rest."""
        if self.settings.presence != "peers":
            return
        peers = peers - {self.me, COORD}
        added, removed = peers - self._watched, self._watched - peers
        if added:
            self.conn.subscribe([(topics.status(p), 1) for p in sorted(added)])
        for peer in sorted(removed):
            self.conn.unsubscribe(topics.status(peer))
        self._watched = peers

    def hello(self, job: str) -> None:
        if not self._hello_doc:
            bps = self.settings.link_bps
            self._hello_doc = {
                "id": self.me, "session": self.session,
                "profile": {"name": "loadgen", "machine": self.settings.machine},
                "step_s": 0.01, "link_bps": bps, "up_bps": bps, "down_bps": bps,
                "rtt_s": 0.001, "encode_s": [0.0, 0.0], "decode_s": [0.0, 0.0], "threads": 1,
                "machine": self.settings.machine, "fedring": "loadgen", "torch": "",
                "python": "", "started": time.time(), "mem_total": 0,
            }  # fmt: skip
        doc = {**self._hello_doc, "job": job, "rss": 0}
        [frame] = self.codec.encode("hello", "-", COORD, doc, sign=False)
        self.conn.publish(topics.hello(self.me), frame, retain=True)

    async def _beat(self) -> None:
        period = self.settings.keepalive / 3
        await asyncio.sleep(period * (hash(self.me) % 1000) / 1000)  # spread, as real starts are
        beat = f"{self.session} {self.settings.keepalive} rss=0".encode()
        while True:
            self.conn.publish(topics.beat(self.me), beat, qos=0)
            await asyncio.sleep(period)

    async def stop(self) -> None:
        """Leave as a daemon does on SIGTERM: hello cleared, status offline, DISCONNECT."""
        if self._beats is not None:
            self._beats.cancel()
        if self.seg is not None and self.seg.task is not None:
            self.seg.task.cancel()
        try:
            self.conn.publish(topics.hello(self.me), b"", retain=True)
            self.conn.publish(topics.status(self.me), self.status("offline"), retain=True)
            self.conn.close()
        except ConnectionError:
            return

    # -- incoming ---------------------------------------------------------------------

    def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        box = topics.parse_inbox(topic)
        if box is not None and box[2] != COORD:
            self._on_peer(box[0], box[2], payload)
            return
        if box is None:
            if topic.endswith("/status") and topic != topics.status(self.me):
                self.times.statuses += 1
            return  # presence and probes: heard (the broker's fan-out), not read
        job = box[0]
        if topics.is_star(job):
            self._on_reply(payload)
            return
        msg = self.codec.decode(COORD, payload)  # None: a part, or refused (counted there)
        if msg is None:
            return
        if msg.kind == "manifest":
            self._on_manifest(msg)
        elif msg.kind == "model":
            self._on_model(msg)
        elif msg.kind == "ack":
            self._on_ack(msg)
        elif msg.kind == "bye":
            self._on_bye(msg)

    def _on_manifest(self, msg: ControlMessage) -> None:
        doc = msg.doc
        self.times.manifests += 1
        self.times.manifest = self.times.manifest or time.monotonic()
        if self.seg is not None and self.seg.task is not None:
            self.seg.task.cancel()
        spec = doc["spec"]
        frame_bytes = int(doc.get("max_frame_bytes") or 0)
        self.pending = None
        self.codec.key = bytes.fromhex(str(doc["key"]))
        seg = Segment(
            job=str(doc["job"]), epoch=int(doc["epoch"]), key=self.codec.key,
            rank=int(doc["rank"]), world=int(doc["world"]), start=int(doc["start_round"]),
            spec=spec, asynchronous=doc.get("mode") == "async",
            limits=FrameLimits(max_frame_bytes=frame_bytes) if frame_bytes else FrameLimits(),
        )  # fmt: skip
        seg.acked = seg.committed = seg.start
        if not seg.asynchronous and spec.get("topology") != "star":
            try:
                shape = RingShape.from_manifest(self.me, seg.channel_job, doc, self.params.numel,
                                                _k(spec))  # fmt: skip
            except (KeyError, TypeError, ValueError) as exc:
                self.times.refused_jobs += 1
                log.error("%s refused the job: %s", self.me, exc)
                self._send(seg, "nack", {"epoch": seg.epoch, "why": f"refused: {exc}"})
                return
            seg.ring = RingPeer(shape, seg.key, seg.limits)
        peers = doc.get("peers")
        self.watch({str(p) for p in peers.values()} if isinstance(peers, dict) else set())
        if self.seg is None or self.seg.job != seg.job:  # a new job: as `MqttLink.join`
            self.conn.subscribe([(topics.job_broadcasts(seg.job), 1),
                                 (topics.job_broadcasts(topics.star(seg.job)), 1)])  # fmt: skip
            self.hello(seg.job)
        self.pending = seg
        if self.params.numel:  # this process knows the model's size: no need to wait
            self._begin(seg)

    def _on_model(self, msg: ControlMessage) -> None:
        seg = self.pending
        if seg is None or msg.job != seg.job or msg.round != seg.start:
            return
        self.times.model = self.times.model or time.monotonic()
        self.params.numel = self.params.numel or len(msg.blob) // 4
        self._begin(seg)

    def _on_peer(self, job: str, src: str, data: bytes) -> None:
        """A ring frame from another agent: the newest manifest's ring takes it."""
        seg = self.pending or self.seg
        if seg is not None and seg.ring is not None and job == seg.job:
            seg.ring.take(src, data)

    def _begin(self, seg: Segment) -> None:
        self.pending, self.seg = None, seg
        if seg.ring is not None:
            seg.ring.set_numel(self.params.numel)
        self._send(seg, "ack", {"epoch": seg.epoch, "start_round": seg.start, "step_s": 0.01,
                                "numel": self.params.numel})  # fmt: skip
        if not self.times.ack:
            self.times.ack = time.monotonic()
        body = (self._async_member if seg.asynchronous
                else self._ring_member if seg.ring is not None else self._star_member)  # fmt: skip
        seg.task = asyncio.create_task(self._guard(seg, body(seg)))

    def _on_ack(self, msg: ControlMessage) -> None:
        seg = self.seg
        if seg is not None and msg.doc.get("epoch") == seg.epoch:
            seg.acked = max(seg.acked, int(msg.doc.get("round", 0)))
            if msg.doc.get("send") == "model":  # its copy is off: the head's whole model
                self._upload(seg, int(msg.doc.get("round", 0)))
            seg.acks.set()

    def _on_bye(self, msg: ControlMessage) -> None:
        seg = self.seg
        if msg.doc.get("why") == "done":
            self.times.done = time.monotonic()
            self.watch(set())
            self.hello("")
            self.finished.set()
        elif seg is not None and seg.task is not None and not seg.task.done():
            seg.task.cancel()
            held = self.params.sha256(seg.committed)
            self._send(seg, "nack", {"epoch": seg.epoch, "committed": seg.committed,
                                     "why": "halted", "sha256": held})  # fmt: skip

    def _on_reply(self, data: bytes) -> None:
        seg = self.seg
        if seg is None:
            return
        try:
            frame = decode_compact(data, job=seg.channel_job, src=COORD, dsts=(self.me, "*"),
                                   key=seg.key, limits=seg.limits)  # fmt: skip
            done = seg.parts.add(frame)
        except FrameError:
            self.times.refused += 1
            return
        if done is not None:
            seg.replies.put_nowait((done[0].round, done[0].phase, bytes(done[1])))

    # -- a segment --------------------------------------------------------------------

    async def _guard(self, seg: Segment, body: Any) -> None:
        try:
            await body
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or a lost broker: report it as a real agent does
            log.warning("%s: segment %d failed: %r", self.me, seg.epoch, exc)
            self._send(seg, "nack", {"epoch": seg.epoch, "committed": seg.committed,
                                     "why": f"error: {exc}"})  # fmt: skip

    async def _star_member(self, seg: Segment) -> None:
        spec, up = seg.spec, self._up_payload(seg)
        timeout = float(spec.get("timeout_s", 60))

        async def exchange(r: int) -> dict[str, Any]:
            if seg.rank in sampled(int(spec.get("seed", 0)), r, seg.world,
                                   float(spec.get("sample", 1.0))):  # fmt: skip
                self._send_up(seg, up, r)
            await self._reply(seg, r, ("down",), timeout)
            return {}

        await self._sync_rounds(seg, exchange)

    async def _ring_member(self, seg: Segment) -> None:
        ring, timeout = seg.ring, float(seg.spec.get("timeout_s", 60))
        assert ring is not None

        def publish(dst: str, data: bytes) -> None:
            self.conn.publish(topics.inbox(seg.job, dst, self.me), data)

        async def exchange(r: int) -> dict[str, Any]:
            comm = await ring.run_round(publish, r, timeout)
            # The keys of a real ring member's row (`engine.loop._round`); no training here.
            return {"grad_norm": 0.0, "interval": 1, "compression_error": 0.0,
                    "residual_norm": 0.0, "bytes_sent": ring.stats.bytes_sent,
                    "compute_s": 0.0, "comm_s": comm, "step_s": comm}  # fmt: skip

        await self._sync_rounds(seg, exchange)

    async def _sync_rounds(self, seg: Segment, exchange: Exchange) -> None:
        """A synchronous job's rounds around `exchange` (a star's or a ring's): the
        head's checkpoint gate, the checkpoint stream, the metrics rows, the bye."""
        spec = seg.spec
        rounds, every = int(spec["rounds"]), int(spec.get("checkpoint_every", 1))
        eval_every, timeout = int(spec.get("eval_every", 10)), float(spec.get("timeout_s", 60))
        uploaded, base = seg.start, -1
        for r in range(seg.start, rounds):
            if seg.head:
                await self._gate(seg, r - r % every, timeout * 3)
            row = await exchange(r)
            seg.committed, self.times.rounds = r + 1, self.times.rounds + 1
            if (r + 1) % every == 0:
                base = self._checkpoint(seg, r + 1, base)
                uploaded = r + 1
            self._metrics(seg, r + 1, eval_every, rounds, row)
        if uploaded != seg.committed:
            self._checkpoint(seg, seg.committed, base)
        if seg.head:
            await self._gate(seg, seg.committed, timeout * 3)
        self._bye(seg, seg.committed)

    async def _async_member(self, seg: Segment) -> None:
        timeout = float(seg.spec.get("timeout_s", 60))
        up, cycle = self._up_payload(seg), 0
        while True:
            self._send_up(seg, up, cycle)
            phase, body = await self._reply(seg, cycle, ("down", "end"), timeout, any_round=True)
            cycle += 1
            self.times.rounds += 1
            if phase == "end":
                break
        # The final model is the reply's one fp32 array: its bytes hash as the centre's do.
        self._bye(seg, cycle, hashlib.sha256(body).hexdigest())

    def _up_payload(self, seg: Segment) -> tuple[dict[str, Any], bytes]:
        spec = seg.spec
        g = int(spec.get("group_size", 256))
        return star_payload(self.params.numel, g, _k(spec), str(spec.get("value_dtype", "fp16")))

    def _send_up(self, seg: Segment, up: tuple[dict[str, Any], bytes], r: int) -> None:
        meta, body = up
        template = Frame(kind="chunk", job=seg.channel_job, src=self.me, dst=COORD, seq=0,
                         round=r, step=0, phase="up", meta=meta)  # fmt: skip
        frames = split_payload(template, body, self._seq, seg.limits)
        self._seq += len(frames)
        topic = topics.inbox(topics.star(seg.job), COORD, self.me)
        for frame in frames:
            self.conn.publish(topic, encode_compact(frame, seg.key))

    async def _reply(self, seg: Segment, r: int, phases: tuple[str, ...], timeout: float,
                     any_round: bool = False) -> tuple[str, bytes]:  # fmt: skip
        """The centre's reply (phase, payload body) for round `r` (any round: async)."""
        while True:
            got, phase, body = await asyncio.wait_for(seg.replies.get(), timeout)
            if phase in phases and (any_round or got == r):
                return phase, body

    async def _gate(self, seg: Segment, need: int, patience: float) -> None:
        """The head starts a round once the checkpoint before it is saved (`Running.gate`)."""
        deadline = time.monotonic() + patience
        while seg.acked < need:
            seg.acks.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no checkpoint ack for round {need}")
            try:
                await asyncio.wait_for(seg.acks.wait(), left)
            except TimeoutError:
                continue

    def _checkpoint(self, seg: Segment, r: int, base: int) -> int:
        """The checkpoint stream (`edge_agent.checkpoint_stream`): the head's dense upload
        at the segment's first, every other member's patch of its slice after it."""
        if seg.head:
            if base < 0:
                self._upload(seg, r)
            return r
        if base < 0:
            return r  # the head's dense upload is the base
        n, i = seg.world - 1, seg.rank - 1
        lo, hi = self.params.numel * i // n, self.params.numel * (i + 1) // n
        doc, blob = encode_patch(self.params.at(base)[lo:hi], self.params.at(r)[lo:hi], lo=lo)
        doc = {"round": r, "epoch": seg.epoch, "from": base, "sha256": self.params.sha256(r), **doc}
        self._send(seg, "model", doc, blob, round=r)
        return r

    def _upload(self, seg: Segment, r: int) -> None:
        doc = {"round": r, "sha256": self.params.sha256(r), "epoch": seg.epoch}
        self._send(seg, "model", doc, self.params.at(r).tobytes(), round=r)

    def _metrics(self, seg: Segment, rnd: int, eval_every: int, rounds: int,
                 extra: dict[str, Any]) -> None:  # fmt: skip
        evaluated = rnd % eval_every == 0 or rnd == rounds
        if not (seg.head or evaluated):
            return
        row: dict[str, Any] = {"round": rnd, "loss": 0.0, "lr": 0.0, "bytes_sent":
                               self.conn.bytes_sent, **extra, "machine": self.settings.machine,
                               "epoch": seg.epoch}  # fmt: skip
        if evaluated:
            row.update(accuracy=0.0, test_loss=0.0, sha256=self.params.sha256(rnd))
            if seg.ring is not None:
                row.update(verdict="ok", samples=0)
        [frame] = self.codec.encode("metrics", seg.job, COORD, row)
        self.conn.publish(topics.metrics(seg.job, self.me), frame)

    def _bye(self, seg: Segment, rounds: int, sha256: str = "") -> None:
        self._send(seg, "bye", {"rounds": rounds, "accuracy": 0.0, "test_loss": 0.0,
                                "sha256": sha256 or self.params.sha256(rounds), "rollbacks": 0,
                                "epoch": seg.epoch, "ring_bytes_sent":
                                seg.ring.stats.bytes_sent if seg.ring is not None else 0,
                                "link_bytes_sent": self.conn.bytes_sent,
                                "checkpoint_bytes_sent": 0, "counters": {},
                                "threads": 1})  # fmt: skip

    def _send(self, seg: Segment, kind: str, doc: dict[str, Any], blob: bytes = b"", *,
              round: int = 0) -> None:  # fmt: skip
        for frame in self.codec.encode(kind, seg.job, COORD, doc, blob, round=round):
            self.conn.publish(topics.inbox(seg.job, COORD, self.me), frame)


def _k(spec: dict[str, Any]) -> int:
    """Entries kept a group: the job's k (`JobSpec.k`)."""
    g = int(spec.get("group_size", 256))
    return min(g, max(1, round(float(spec.get("density", 0.01)) * g)))

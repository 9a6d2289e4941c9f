"""The coordinator's end of the broker: what it sends, what it takes in, who is there.

`ControlPort` holds the link, the control codec and what the coordinator learns from
the broker about its agents: their hellos and probes (`Fleet`), the peers members
reported lost (`Suspects`) and the agents that refused the job. It sends control
frames, publishes the job's retained manifest, reads the control queue (hellos and
sessions are taken in as they come), and waits for the link's verdict on suspects
before it names the next ring (`epoch.next_ring`). `service.Coordinator` drives a job
on top of it; the decisions it takes are in `coordinator.epoch`.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from fedring.coordinator import epoch as decide
from fedring.coordinator.checkpoint import Checkpoint
from fedring.coordinator.membership import Fleet, Suspects
from fedring.counters import Counters
from fedring.training.sharding import ShardManifest
from fedring.transport import topics
from fedring.transport.base import Deadline, TransportError
from fedring.transport.mqtt import SILENT_AFTER, BrokerConfig, Control, MqttLink
from fedring.wire.control import ControlCodec, ControlMessage

log = logging.getLogger(__name__)
SEND_S = 10.0
# Seconds past a peer's silence limit (SILENT_AFTER x its keep-alive) before the link's
# silence check, which runs every 0.25 s, has surely seen a peer that stopped beating.
VERDICT_MARGIN_S = 1.0
# How long a ring that would be empty waits for holders that fell silent (hung or
# starved, not gone: no will, no goodbye) to beat again before the job gives up.
SILENT_WAIT_S = 60.0


class CoordinatorError(RuntimeError):
    """The job could not run: too few agents, every agent lost, no progress."""


def next_control(link: MqttLink, timeout: float) -> Control | None:
    """The next item of a coordinator's control queue, or None after `timeout`; raises
    `CoordinatorError` once the link stepped back for another holder of the id
    (`coordinator.lease`): fighting it helps nobody."""
    if link.taken_over:
        raise CoordinatorError(f"one broker runs one coordinator: {link.taken_over}")
    try:
        return link.control.get(timeout=timeout)
    except queue.Empty:
        return None


class ControlPort:
    """The coordinator's link and codec, and what it knows of the agents from them."""

    def __init__(self, cfg: BrokerConfig) -> None:
        self.cfg = cfg
        self.counters = Counters()
        self.codec = ControlCodec(topics.COORDINATOR, counters=self.counters)
        self.link: MqttLink | None = None
        self.ck: Checkpoint | None = None  # the job: its id, key, shard holders
        self.fleet = Fleet()  # hellos and probes: ring order, frame size, patience
        self.suspects = Suspects()  # peers members reported lost: out until the link agrees
        self.refused: dict[str, str] = {}  # agents that cannot take this job -> why

    # -- who is there -------------------------------------------------------------

    def _ready(self) -> set[str]:
        assert self.link is not None
        return set(self.fleet.hellos) & set(self.link.peers())

    def _members(self) -> list[str]:
        """The next ring: online holders of a shard that did not refuse the job, once the
        link has its own verdict on every peer a member reported lost (`Suspects`). Where
        none is online but some fell silent without leaving (a board busy behind its own
        sends), it waits up to `SILENT_WAIT_S` for one to beat again."""
        assert self.ck is not None and self.link is not None
        self._poll(0.0)
        deadline = Deadline.after(max(map(self._verdict_s, self.ck.shards), default=0.0))
        while self.suspects.pending(self.link.peers(), time.monotonic(), self._verdict_s):
            if deadline.expired:
                break
            self._poll(0.1)
        wait: Deadline | None = None  # for a silent holder to beat again, once begun
        while True:
            ring = decide.next_ring(self.fleet, self._ready(), self.ck.shards, self.refused)
            silent = self.link.silent_peers() & set(self.ck.shards)
            if ring or not silent or (wait is not None and wait.expired):
                return ring
            if wait is None:
                log.warning("every holder of a shard is offline; %s fell silent without "
                            "leaving: waiting up to %g s for one to beat again",
                            ", ".join(sorted(silent)), SILENT_WAIT_S)  # fmt: skip
                self.counters.add("ring_waited_for_silent")
                wait = Deadline.after(SILENT_WAIT_S)
            self._poll(0.1)

    def _verdict_s(self, agent: str) -> float:
        """How long after a report the link's watch has surely seen `agent` go silent."""
        keepalive = self.fleet.profile(agent, "keepalive_s") or self.cfg.keepalive
        return SILENT_AFTER * keepalive + VERDICT_MARGIN_S

    def _note_nack(self, msg: ControlMessage) -> None:
        """What a member's nack says beyond "stopped": it refused the job (for good), or
        it lost a peer (a suspect until the link's verdict)."""
        refusal, peer = decide.nack_report(msg.src, msg.doc)
        if refusal:
            self.refused[msg.src] = refusal
        if peer:
            self.suspects.report(peer, time.monotonic())

    # -- in and out --------------------------------------------------------------

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
        item = next_control(self.link, timeout)
        if item is None:
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

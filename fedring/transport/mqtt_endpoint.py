"""The `Endpoint` of one job over an `MqttLink`: what `PeerChannel` sends and receives on.

Frames go out through the link (`MqttLink.send_to`, `MqttLink.broadcast_to`); they come
in from the link's data queue, shared by the jobs the link is in (a frame of another
job is dropped here and counted as ``frame_other_job``), or from a queue of the
endpoint's own (*private*: every sender in the job, the coordinator included).
"""

from __future__ import annotations

import queue
import time
from typing import Protocol

from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import (
    BROADCAST,
    Deadline,
    Delivery,
    LinkStats,
    MembershipEvent,
    PeerUnreachable,
    TransportTimeout,
)
from fedring.transport.mqtt_broker import BrokerConfig
from fedring.transport.mqtt_inbox import DataItem, Inbox, Inboxes


class Link(Protocol):
    """What an endpoint needs of its `MqttLink` (a protocol: the link module imports
    this one, so this one does not import it)."""

    me: str
    cfg: BrokerConfig
    counters: Counters

    def peers(self) -> frozenset[str]: ...

    def send_to(self, job: str, dst: str, data: bytes, deadline: Deadline) -> None: ...

    def broadcast_to(self, job: str, data: bytes, deadline: Deadline) -> None: ...


class MqttEndpoint:
    """The `Endpoint` of one job over a link: what `PeerChannel` sends and receives on."""

    def __init__(self, link: Link, job: str, inboxes: Inboxes, *, private: bool = False
                 ) -> None:  # fmt: skip
        self.link = link
        self.job = topics.check_id("job", job)
        self.name = link.me
        self.stats = LinkStats()  # this job's ring frames only; `link.stats` counts everything
        self._inboxes, self._private = inboxes, private
        self.inbox: Inbox[DataItem] = inboxes.open_private(self.job) if private else inboxes.data

    def send(self, dst: str, data: bytes, deadline: Deadline) -> None:
        soon = Deadline.after(min(2.0, deadline.remaining()))
        while dst not in self.link.peers() and not soon.expired:
            time.sleep(0.02)  # its retained status may not have reached us yet
        if dst not in self.link.peers():
            raise PeerUnreachable(f"{dst!r} is not online at broker {self.link.cfg.url}")
        self.link.send_to(self.job, dst, data, deadline)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(data)
        self.stats.per_peer_sent[dst] = self.stats.per_peer_sent.get(dst, 0) + len(data)

    def broadcast(self, data: bytes, deadline: Deadline) -> None:
        """One publish that every member of the job receives (see `Broadcaster`)."""
        self.link.broadcast_to(self.job, data, deadline)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(data)
        self.stats.per_peer_sent[BROADCAST] = self.stats.per_peer_sent.get(BROADCAST, 0) + len(data)

    def recv(self, deadline: Deadline) -> Delivery | MembershipEvent:
        while True:
            try:
                item = self.inbox.get(timeout=max(deadline.remaining(), 1e-4))
            except queue.Empty:
                raise TransportTimeout(
                    f"{self.name!r} received nothing before the deadline"
                ) from None
            if isinstance(item, tuple):
                job, delivery = item
                if job != self.job:
                    self.link.counters.add("frame_other_job")
                    continue
                self.stats.frames_received += 1
                self.stats.bytes_received += len(delivery.data)
                return delivery
            return item

    def peers(self) -> frozenset[str]:
        return self.link.peers()

    def close(self) -> None:
        """The link outlives the job; closing a job's endpoint leaves it connected
        (a private endpoint's frames are dropped from now on)."""
        if self._private:
            self._inboxes.close_private(self.job)

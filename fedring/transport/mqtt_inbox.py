"""The bounded incoming queues of one MQTT link, filled on paho's network thread.

`Inboxes` holds a link's queues: **data** (ring frames and broadcasts, as
``(job, Delivery)``, and membership changes), **control** (`Control` items for the
daemon's or the coordinator's own loop) and one queue per *private* endpoint. Each is an
`Inbox`, bounded in items and payload bytes: paho's thread must never block, so what
does not fit is dropped, counted and logged (`Inboxes.offer`).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from fedring.counters import Counters
from fedring.transport.base import Delivery, MembershipEvent

log = logging.getLogger("fedring.transport.mqtt")


@dataclass(frozen=True)
class Control:
    """A message for the daemon's or the coordinator's own loop."""

    kind: Literal["frame", "hello", "metrics", "member"]
    src: str
    data: bytes = b""
    job: str = ""
    event: MembershipEvent | None = None


DataItem = Delivery | MembershipEvent | tuple[str, Delivery]  # (job, frame) or a change
_Item = TypeVar("_Item", DataItem, Control)


def payload_bytes(item: object) -> int:
    if isinstance(item, tuple):
        item = item[1]
    return len(item.data) if isinstance(item, Delivery | Control) else 0


class Inbox(queue.Queue[_Item], Generic[_Item]):
    """An incoming queue bounded in items and payload bytes.

    paho's network thread fills it and must never block, so `offer` refuses what does
    not fit (the caller counts and logs the drop); `get` and the rest are `queue.Queue`'s.
    """

    def __init__(self, max_items: int, max_bytes: int) -> None:
        super().__init__()
        self.max_items, self.max_bytes = max_items, max_bytes
        self.queued_bytes = 0

    def offer(self, item: _Item) -> bool:
        size = payload_bytes(item)
        with self.not_full:
            if self._qsize() >= self.max_items or self.queued_bytes + size > self.max_bytes:
                return False
            self._put(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()
        return True

    def _put(self, item: _Item) -> None:
        self.queued_bytes += payload_bytes(item)
        self.queue.append(item)

    def _get(self) -> _Item:
        item = self.queue.popleft()
        self.queued_bytes -= payload_bytes(item)
        return item


class Inboxes:
    """A link's incoming queues, and what it does with a message that does not fit.

    The private queues are a dict copied on write: paho's thread reads it without a
    lock while an endpoint opens or closes one.
    """

    def __init__(self, me: str, max_items: int, max_bytes: int, counters: Counters) -> None:
        self.me, self.counters = me, counters
        self._bounds = (max_items, max_bytes)
        self.control: Inbox[Control] = Inbox(*self._bounds)
        self.data: Inbox[DataItem] = Inbox(*self._bounds)
        self.private: dict[str, Inbox[DataItem]] = {}  # job -> a private endpoint's queue
        self._private_lock = threading.Lock()

    def open_private(self, job: str) -> Inbox[DataItem]:
        """`job`'s private queue, made now or earlier (paho's thread may make it first,
        for a star frame that came before its endpoint: `Router`)."""
        with self._private_lock:  # two threads may open one job's queue at once
            inbox = self.private.get(job)
            if inbox is None:
                inbox = Inbox(*self._bounds)
                self.private = {**self.private, job: inbox}
            return inbox

    def close_private(self, job: str) -> None:
        with self._private_lock:
            self.private = {j: q for j, q in self.private.items() if j != job}

    def offer(self, inbox: Inbox[_Item], item: _Item, what: str) -> None:
        if not inbox.offer(item):
            self.dropped("inbox_full", what, payload_bytes(item))

    def dropped(self, reason: str, what: str, size: int) -> None:
        """Count a message we will not hold; log the first and every 1,000th of each reason."""
        self.counters.add(reason)
        count = self.counters.get(reason)
        if count == 1 or count % 1000 == 0:
            why = "not in its job" if reason == "inbox_other_job" else "incoming queue full"
            log.warning("%s dropped %d bytes on %s (%s; %d dropped so far)",
                        self.me, size, what, why, count)  # fmt: skip

    def emit(self, who: str, events: list[MembershipEvent]) -> None:
        """Membership changes go to every queue: each reader sees them."""
        for event in events:
            log.info("%s sees %s %s", self.me, who, event.kind)
            for inbox in (self.data, *self.private.values()):
                self.offer(inbox, event, f"{who} {event.kind}")
            self.offer(self.control, Control("member", who, event=event), f"{who} {event.kind}")

    def interrupt(self, channel_job: str) -> None:
        for inbox in (self.data, *self.private.values()):
            inbox.put(MembershipEvent("interrupted", channel_job))

    @property
    def queued_bytes(self) -> int:
        private = sum(inbox.queued_bytes for inbox in self.private.values())
        return self.data.queued_bytes + self.control.queued_bytes + private

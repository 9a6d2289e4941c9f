"""The segment an agent runs now: its thread, its halt, and the head's checkpoint gate.

The daemon's control loop and the segment's thread share this: the loop sets `halt`
(a ``bye`` or the coordinator gone) and passes on the coordinator's checkpoint acks
(`ack`); the head's thread waits in `gate` before each round until the state at the
last checkpoint round is saved, so that agents never run more than `checkpoint_every`
rounds past what a restarted coordinator can resume from.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fedring.collective.channel import CollectiveTimeout
from fedring.edge_agent.worker import Halted, Segment
from fedring.transport.base import Deadline


@dataclass
class Running:
    seg: Segment
    thread: threading.Thread
    halt: threading.Event = field(default_factory=threading.Event)
    acked: int = 0  # the coordinator has saved the state at the start of this round
    cond: threading.Condition = field(default_factory=threading.Condition)

    def gate(self, r: int, every: int, patience: float) -> None:
        """The head starts round r once the state at the last checkpoint round at or
        before r is saved, so a restarted coordinator redoes at most `every` rounds."""
        deadline = Deadline.after(patience)
        need = r - r % every
        with self.cond:
            while self.acked < need and not self.halt.is_set():
                if deadline.expired:
                    raise CollectiveTimeout(f"no checkpoint ack for round {r}")
                self.cond.wait(min(0.5, deadline.remaining()))
        if self.halt.is_set():
            raise Halted(f"halted before round {r}")

    def ack(self, r: int) -> None:
        with self.cond:
            self.acked = max(self.acked, r)
            self.cond.notify_all()

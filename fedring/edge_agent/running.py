"""The segment an agent runs now: its thread, its halt, and the head's checkpoint gate.

The daemon's control loop and the segment's thread share this: the loop sets `halt`
(a ``bye`` or the coordinator gone) and passes on the coordinator's checkpoint acks
(`ack`); the head's thread waits in `gate` before each round until the state at the
last checkpoint round is saved, so that agents never run more than `checkpoint_every`
rounds past what a restarted coordinator can resume from.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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
    wanted: int = -1  # the coordinator asks the head for the whole model of this round
    cond: threading.Condition = field(default_factory=threading.Condition)

    def gate(
        self, r: int, every: int, patience: float, upload: Callable[[int], None] | None = None
    ) -> None:
        """The head starts round r once the state at the last checkpoint round at or
        before r is saved, so a restarted coordinator redoes at most `every` rounds.
        Asked for the whole model of that round meanwhile (`want`), it `upload`s it:
        it holds that state while it waits."""
        deadline = Deadline.after(patience)
        need = r - r % every
        while True:
            with self.cond:
                while (self.acked < need and not self.halt.is_set()
                       and self.wanted != need):  # fmt: skip
                    if deadline.expired:
                        raise CollectiveTimeout(f"no checkpoint ack for round {r}")
                    self.cond.wait(min(0.5, deadline.remaining()))
                send = self.wanted == need and self.acked < need and not self.halt.is_set()
                self.wanted = -1
            if not send or upload is None:
                break
            upload(need)  # outside the lock: the ack that follows must get in
        if self.halt.is_set():
            raise Halted(f"halted before round {r}")

    def ack(self, r: int) -> None:
        with self.cond:
            self.acked = max(self.acked, r)
            self.cond.notify_all()

    def want(self, r: int) -> None:
        """The coordinator asks for the whole model at the start of round r."""
        with self.cond:
            self.wanted = r
            self.cond.notify_all()

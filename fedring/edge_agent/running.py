"""The segment an agent runs now: its thread, its halt, and the head's checkpoint gate.

The daemon's control loop and the segment's thread share this: the loop sets `halt`
(a ``bye`` or the coordinator gone) and passes on the coordinator's checkpoint acks
(`ack`); the head's thread waits in `gate` before each round until the state at the
checkpoint round before the last one is saved, so that agents never run more than
``2 x checkpoint_every`` rounds past what a restarted coordinator can resume from,
and the newest checkpoint's round trip and save are off the rounds' path. In a
broadcast collective (``fanout``, ``hub``) every member's thread first waits for the
coordinator's ``go`` (`start`), sent once every member acknowledged its manifest, and
so subscribed to the job's broadcasts (the start barrier, docs/design.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from fedring.collective.channel import CollectiveTimeout
from fedring.edge_agent.worker import Halted, Segment
from fedring.transport.base import Deadline


def wait_for_go(go: threading.Event, halt: threading.Event, deadline: Deadline,
                what: str) -> None:  # fmt: skip
    """Wait until the coordinator says go (a ring's start barrier, a pipeline's start):
    `Halted` if halted first, `CollectiveTimeout` at `deadline`; `what` names the wait."""
    while not go.wait(min(0.2, deadline.remaining())):
        if halt.is_set():
            raise Halted(f"halted before {what}")
        if deadline.expired:
            raise CollectiveTimeout(f"no word from the coordinator: waited for {what}")
    if halt.is_set():
        raise Halted(f"halted before {what}")


@dataclass
class Running:
    seg: Segment
    thread: threading.Thread
    halt: threading.Event = field(default_factory=threading.Event)
    acked: int = 0  # the coordinator has saved the state at the start of this round
    wanted: int = -1  # the coordinator asks the head for the whole model of this round
    cond: threading.Condition = field(default_factory=threading.Condition)
    go: threading.Event = field(default_factory=threading.Event)  # the coordinator's go

    def start(self, patience: float) -> None:
        """Wait for the coordinator's go (every member hears the broadcasts now)."""
        wait_for_go(self.go, self.halt, Deadline.after(patience), "the go")

    def gate(
        self, r: int, every: int, patience: float, upload: Callable[[int], None] | None = None,
        *, ahead: int = 1,
    ) -> None:
        """The head starts round r once the state at the checkpoint round `ahead`
        checkpoints before the last one at or before r is saved: with ``ahead = 1`` the
        newest checkpoint's upload, patches and save overlap the next `every` rounds, and
        a restarted coordinator redoes at most ``2 x every`` rounds (``ahead = 0``: the
        last one itself, as before the bye). Asked meanwhile for the whole model of a
        round not yet saved (`want`), it `upload`s it from the state it holds."""
        deadline = Deadline.after(patience)
        need = r - r % every - ahead * every
        while True:
            with self.cond:
                while (self.acked < need and not self.halt.is_set()
                       and self.wanted <= self.acked):  # fmt: skip
                    if deadline.expired:
                        raise CollectiveTimeout(f"no checkpoint ack for round {need}")
                    self.cond.wait(min(0.5, deadline.remaining()))
                wanted = self.wanted if self.wanted > self.acked else -1
                self.wanted = -1
            if self.halt.is_set():
                raise Halted(f"halted before round {r}")
            if wanted >= 0 and upload is not None:
                upload(wanted)  # outside the lock: the ack that follows must get in
                continue
            if self.acked >= need:
                return

    def ack(self, r: int) -> None:
        with self.cond:
            self.acked = max(self.acked, r)
            self.cond.notify_all()

    def want(self, r: int) -> None:
        """The coordinator asks for the whole model at the start of round r (the newest
        ask wins: its save acks the older rounds too)."""
        with self.cond:
            self.wanted = max(self.wanted, r)
            self.cond.notify_all()

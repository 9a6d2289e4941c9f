"""The boards of a pipeline job as the coordinator sees them, and the errors that end it.

`StageFleet` holds the coordinator's MQTT link for a pipeline job: it takes in the
agents' hellos (their board profiles), enrols the first S agents online by id (the
same stages for the same fleet), turns a hello's profile into the `Board` a stage is
planned on, and sends and receives the job's control messages. Every wait has a
deadline; every refusal is counted and logged (`refused`).
"""

from __future__ import annotations

import logging
from typing import Any

from fedring.coordinator.membership import number
from fedring.coordinator.port import next_control
from fedring.coordinator.service import CoordinatorError
from fedring.counters import Counters
from fedring.pipeline.partition import Board
from fedring.transport import topics
from fedring.transport.base import Deadline, TransportError
from fedring.transport.mqtt import BrokerConfig, Control, MqttLink
from fedring.wire.control import ControlCodec, ControlMessage

log = logging.getLogger(__name__)

SETTLE_S = 1.0  # after enough hellos: the rest of the retained burst, for the order by id
SEND_S = 30.0


class PipelineError(CoordinatorError):
    """A pipeline job that could not run or finish; `stage`, `agent` and (in an S x D grid)
    `replica` name the culprit."""

    def __init__(self, message: str, stage: int = -1, agent: str = "", replica: int = -1) -> None:
        super().__init__(message)
        self.stage, self.agent, self.replica = stage, agent, replica


class StageLost(PipelineError):
    """A stage's agent went away (last-will, silence) mid-job."""


class StageFailed(PipelineError):
    """A stage stopped with an error (its ``nack``), or refused the job."""


class StageStalled(PipelineError):
    """No word from any stage for longer than the job allows."""


def refused(counters: Counters, counter: str, why: str) -> PipelineError:
    """The job cannot start: counted, logged, and the error to raise."""
    counters.add(counter)
    log.error("pipeline job refused: %s", why)
    return PipelineError(why)


class StageFleet:
    def __init__(self, cfg: BrokerConfig, counters: Counters) -> None:
        self.cfg, self.counters = cfg, counters
        self.codec = ControlCodec(topics.COORDINATOR, counters=counters)
        self.hellos: dict[str, dict[str, Any]] = {}
        self.link = MqttLink(cfg, topics.COORDINATOR, control_from=("*",), listen_hellos=True,
                             watch=True, counters=counters)  # fmt: skip

    def enrol(self, want: int, timeout_s: float) -> list[str]:
        """The first `want` agents by id, once that many are online with a hello.

        Once `want` are there it listens `SETTLE_S` more: the broker hands over the
        retained hellos of boards already online in one burst, in no set order, and a
        board with a lower id must not become the spare for arriving a moment late."""
        deadline = Deadline.after(timeout_s)
        log.info("waiting for %d agents on %s", want, self.cfg.url)
        while len(self.ready()) < want:
            if deadline.expired:
                have = sorted(self.ready())
                raise refused(self.counters, "enrol_timeout", f"only {len(have)} of {want} "
                              f"agents enrolled within {timeout_s:g} s: {have}")  # fmt: skip
            self.next(0.2)
        settle = Deadline.after(SETTLE_S)
        while not settle.expired:
            self.next(0.1)
        members = sorted(self.ready())[:want]
        log.info("pipeline: stages on %s", members)
        return members

    def ready(self) -> set[str]:
        """Agents online that have said hello."""
        return set(self.hellos) & set(self.link.peers())

    def online(self, agent: str) -> bool:
        return agent in self.link.peers()

    def board(self, agent: str) -> Board:
        """The board an agent's hello announces (no profile: no budget known)."""
        profile = self.hellos[agent].get("profile")
        p = profile if isinstance(profile, dict) else {}
        budget = number(p.get("ram_budget_mb")) or float("inf")
        return Board(str(p.get("profile") or p.get("name") or "generic"),
                     number(p.get("gflops")) or 1.0, budget)  # fmt: skip

    def send(self, job: str, dst: str, kind: str, doc: dict[str, Any], blob: bytes = b"", *,
             round: int = 0, sign: bool = True) -> None:  # fmt: skip
        try:
            for frame in self.codec.encode(kind, job, dst, doc, blob, round=round, sign=sign):
                self.link.send_to(job, dst, frame, Deadline.after(SEND_S))
        except TransportError as exc:
            self.counters.add("send_failed")
            log.warning("could not send %s to %s: %s", kind, dst, exc)

    def next(self, timeout: float) -> Control | None:
        """The next control item (hellos are taken in on the way), or None."""
        item = next_control(self.link, timeout)
        if item is None:
            return None
        if item.kind == "hello":
            codec = ControlCodec(topics.COORDINATOR, counters=self.counters)
            msg = codec.decode(item.src, item.data)
            if msg is not None and msg.kind == "hello":
                self.hellos[item.src] = msg.doc
            elif msg is not None:
                self.counters.add("frame_unexpected")
                log.warning("a %r frame on the hello topic of %r, refused", msg.kind, item.src)
        return item

    def decode(self, item: Control) -> ControlMessage | None:
        if item.kind not in ("frame", "metrics"):
            return None
        return self.codec.decode(item.src, item.data)  # refusals counted and logged there

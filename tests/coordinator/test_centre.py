"""The coordinator's star centre (`coordinator.centre.StarCentre`) over the in-process
transport: a centre that fails by itself keeps its error for the coordinator to raise;
one stopped by its agents or its owner leaves that to them."""

from __future__ import annotations

import time

import pytest
import torch

import fedring.engine.centre as engine_centre
from fedring.aggregation.rules import Aggregation
from fedring.collective.channel import PeerChannel
from fedring.compression.quantize import DenseCodec
from fedring.config import JobSpec
from fedring.coordinator.centre import StarCentre
from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import Deadline, MembershipEvent
from fedring.transport.inproc import InprocEndpoint, InprocTransport

D, KEY, JOB = 8, b"k" * 32, "job"


class _Link:
    """The two things `StarCentre` asks of an `MqttLink`, in process."""

    def __init__(self, hub: InprocTransport) -> None:
        self.hub = hub
        self.centre: InprocEndpoint | None = None

    def endpoint(self, job: str, *, private: bool = False) -> InprocEndpoint:
        self.centre = self.hub.connect(topics.COORDINATOR)
        return self.centre

    def interrupt(self, channel_job: str) -> None:
        assert self.centre is not None
        self.centre._event(MembershipEvent("interrupted", channel_job))


def _started(hub: InprocTransport, names: list[str]) -> StarCentre:
    centre = StarCentre(_Link(hub), JOB, KEY, Counters())  # type: ignore[arg-type]
    # dense uplinks: a median over group-top-k would first wait for the members' votes
    spec = JobSpec(agents=len(names), topology="star", aggregation="median", rounds=3,
                   compression="none")  # fmt: skip
    centre.start(spec, 0, names, 0, torch.zeros(D))
    return centre


def _send_up(ch: PeerChannel, rnd: int) -> None:
    ch.send(topics.COORDINATOR, DenseCodec("fp32").compress(torch.ones(D)), round=rnd, step=0,
            phase="up", deadline=Deadline.after(5))  # fmt: skip


def _ended(centre: StarCentre) -> None:
    deadline = Deadline.after(10)
    while centre.running and not deadline.expired:
        time.sleep(0.01)
    assert not centre.running


def test_a_centre_that_fails_by_itself_hands_its_error_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(updates: torch.Tensor, rule: Aggregation) -> torch.Tensor:
        raise RuntimeError("injected: the centre's rule failed")

    monkeypatch.setattr(engine_centre, "combine", failing)
    hub = InprocTransport()
    agents = {n: PeerChannel(hub.connect(n), f"{JOB}.e0", key=KEY) for n in ("a", "b")}
    centre = _started(hub, list(agents))
    centre.check()  # nothing yet
    for ch in agents.values():
        _send_up(ch, 0)
    _ended(centre)
    with pytest.raises(RuntimeError, match="injected: the centre's rule failed"):
        centre.check()
    assert centre.counters.snapshot().get("centre_failed") == 1
    centre.close()


def test_a_centre_its_owner_interrupts_leaves_nothing_to_raise() -> None:
    hub = InprocTransport()
    for n in ("a", "b"):
        hub.connect(n)
    centre = _started(hub, ["a", "b"])
    centre.stop()  # the end of the epoch, before any round: the agents' business
    centre.check()
    assert centre.failure is None and centre.counters.snapshot().get("centre_stopped") == 1
    centre.close()

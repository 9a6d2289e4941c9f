"""The start barrier of the broadcast collectives (``fanout``, ``hub``), without a broker.

A QoS 1 publish is not kept for a subscriber that comes later, so a member must not
broadcast round 0 before every member subscribed to the job's broadcasts. A member
acknowledges its manifest once the broker confirmed that subscription (its SUBACK);
the coordinator sends every member a go once all acknowledged; a member's segment
waits for it before round 0. The whole over Mosquitto, with a member stopped while
the others start, is `tests/mqtt/test_fanout.py`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fedring.collective.channel import CollectiveTimeout
from fedring.coordinator.manifest import segment_docs
from fedring.coordinator.service import _Epoch
from fedring.edge_agent.daemon import AgentDaemon
from fedring.edge_agent.running import Running
from fedring.edge_agent.worker import Halted, Segment
from fedring.transport import topics
from fedring.transport.mqtt import BrokerConfig, Control
from fedring.wire.control import ControlCodec
from tests.coordinator.test_manifest import _checkpoint
from tests.coordinator.test_reports import AGENTS, JOB, KEY, _coordinator


@pytest.mark.parametrize(
    ("collective", "mode", "barrier"),
    [("fanout", "ring", True), ("hub", "ring", True), ("ring", "ring", False),
     ("auto", "ring", False), ("fanout", "async", False)],
)  # fmt: skip
def test_a_broadcast_collectives_manifests_ask_for_the_barrier(
    collective: str, mode: str, barrier: bool
) -> None:
    """``auto`` unplanned runs the ring; a degraded ring (async) goes through the centre."""
    ck, members, _ = _checkpoint(4)
    docs = segment_docs(ck, members, 0, 0, 0, mode, collective=collective)
    assert [doc.get("barrier", False) for doc in docs.values()] == [barrier] * 4


def _ack(src: str, epoch: int = 0) -> Control:
    [frame] = ControlCodec(src, key=KEY).encode("ack", JOB, topics.COORDINATOR, {
        "epoch": epoch, "start_round": 5, "step_s": 0.01, "numel": 100})  # fmt: skip
    return Control("frame", src, frame, JOB)


@pytest.mark.parametrize("barrier", [True, False])
def test_the_go_goes_to_every_member_once_all_acknowledged(
    tmp_path: Path, barrier: bool
) -> None:
    c, _link = _coordinator(tmp_path)
    sent: list[tuple[str, str, dict[str, Any]]] = []
    c._send = lambda dst, kind, doc, *_a, **_k: sent.append((dst, kind, doc))  # type: ignore[method-assign]
    ep = _Epoch(0, list(AGENTS), 5)
    ep.barrier = barrier
    for agent in AGENTS[:3]:
        assert c._on_item(ep, _ack(agent)) == ("", False)
    c._on_item(ep, _ack("a0"))  # a repeated ack is not the last one
    c._on_item(ep, _ack("a3", epoch=1))  # nor one of another epoch
    assert sent == []
    c._on_item(ep, _ack("a3"))
    c._on_item(ep, _ack("a3"))  # once only
    go = {"epoch": 0, "go": True}
    assert sent == ([(a, "ack", go) for a in AGENTS] if barrier else [])
    assert c.t0 is not None


def _running(**seg: Any) -> Running:
    return Running(Segment("j", 0, ["a1", "a2"], 0, "", "a1", **seg), threading.Thread())


def test_a_segment_starts_at_the_go_and_not_before() -> None:
    run = _running(barrier=True)
    threading.Timer(0.3, run.go.set).start()
    started = time.monotonic()
    run.start(10.0)
    assert 0.25 < time.monotonic() - started < 5


def test_a_halt_or_the_deadline_ends_the_wait_for_the_go() -> None:
    run = _running(barrier=True)
    threading.Timer(0.2, run.halt.set).start()
    with pytest.raises(Halted):
        run.start(10.0)
    with pytest.raises(CollectiveTimeout, match="no word from the coordinator: waited for the go"):
        _running(barrier=True).start(0.3)


def test_the_agent_passes_its_epochs_go_on_and_no_other() -> None:
    daemon = AgentDaemon(BrokerConfig.parse("mqtt://127.0.0.1:1"), "a1")
    codec = ControlCodec("coordinator", key=KEY)
    daemon.codec.key = KEY
    run = daemon.running = _running(barrier=True)
    run.seg.job = JOB

    def send(doc: dict[str, Any]) -> None:
        [frame] = codec.encode("ack", JOB, "a1", doc)
        daemon._handle(Control("frame", "coordinator", frame, JOB))

    send({"epoch": 1, "go": True})  # an earlier or later epoch's
    send({"epoch": 0, "round": 2})  # a checkpoint's ack
    assert not run.go.is_set() and run.acked == 2
    send({"epoch": 0, "go": True})
    assert run.go.is_set() and run.acked == 2

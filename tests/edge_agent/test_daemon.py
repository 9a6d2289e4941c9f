"""The agent daemon's control loop, without a broker: what it does with frames it
cannot use."""

from __future__ import annotations

from fedring.edge_agent.daemon import AgentDaemon
from fedring.transport.mqtt import BrokerConfig, Control
from fedring.wire.control import ControlCodec


def test_a_sealed_frame_queued_for_an_earlier_process_is_dropped_quietly() -> None:
    """The broker keeps an agent's session across a restart, so frames sealed for the
    job its earlier process was in arrive before any manifest: counted as such, not as
    a bad MAC (the log once said "bad_mac ... this job has no key" at every start)."""
    daemon = AgentDaemon(BrokerConfig.parse("mqtt://127.0.0.1:1"), "a1")
    coordinator = ControlCodec("coordinator", key=bytes(range(32)))
    [frame] = coordinator.encode("ack", "job-1", "a1", {"epoch": 0, "round": 3})
    daemon._handle(Control("frame", "coordinator", frame, "job-1"))
    assert daemon.counters.get("frame_before_manifest") == 1
    assert daemon.counters.get("frame_bad_mac") == 0


def test_an_unsealed_frame_still_reaches_the_codec() -> None:
    daemon = AgentDaemon(BrokerConfig.parse("mqtt://127.0.0.1:1"), "a1")
    [frame] = ControlCodec("coordinator").encode("bye", "job-1", "a1", {"why": "x"}, sign=False)
    daemon._handle(Control("frame", "coordinator", frame, "job-1"))
    assert daemon.counters.get("frame_before_manifest") == 0

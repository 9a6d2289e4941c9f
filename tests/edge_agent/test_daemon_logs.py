"""What the agent daemon drops from its control queue is counted each time and logged
a few times (`fedring.logs_limit`), however often it comes. Only the coordinator's
frames reach this queue (a broker user's are routed elsewhere: tests/mqtt/
test_hostile_payloads.py), so the daemon is fed by hand."""

from __future__ import annotations

import logging

import pytest

from fedring.edge_agent.daemon import AgentDaemon
from fedring.transport.mqtt import BrokerConfig, Control
from fedring.wire.control import ControlCodec

LOGGER = "fedring.edge_agent.daemon"


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def daemon() -> AgentDaemon:
    return AgentDaemon(BrokerConfig.parse("mqtt://127.0.0.1:1"), "a1")


def test_a_model_not_waited_for_is_counted_and_logged_a_few_times(
    daemon: AgentDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator = ControlCodec("coordinator")
    with caplog.at_level(logging.INFO, LOGGER):
        for rnd in range(50):
            [frame] = coordinator.encode("model", "job-1", "a1", {"round": rnd}, b"\x00" * 8,
                                         round=rnd, sign=False)  # fmt: skip
            daemon._handle(Control("frame", "coordinator", frame, "job-1"))
    assert daemon.counters.get("model_unexpected") == 50
    got = _lines(caplog)
    assert len(got) == 5
    assert got[0] == ("a1: a model from coordinator for job job-1, round 0, not the one it "
                      "waits for (none): ignored")  # fmt: skip


def test_a_kind_an_agent_does_not_read_is_counted_and_logged(
    daemon: AgentDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator = ControlCodec("coordinator")
    with caplog.at_level(logging.INFO, LOGGER):
        for kind in ("shard", "nack", "chunk"):
            [frame] = coordinator.encode(kind, "job-1", "a1", {}, sign=False)
            daemon._handle(Control("frame", "coordinator", frame, "job-1"))
    assert daemon.counters.get("control_unknown_kind") == 3
    assert _lines(caplog)[0] == ("a1: a 'shard' message from coordinator in job job-1: "
                                 "not a kind an agent reads; ignored")  # fmt: skip


def test_sealed_frames_before_a_manifest_log_a_few_lines(
    daemon: AgentDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator = ControlCodec("coordinator", key=bytes(range(32)))
    with caplog.at_level(logging.INFO, LOGGER):
        for rnd in range(200):
            [frame] = coordinator.encode("ack", "job-1", "a1", {"epoch": 0, "round": rnd})
            daemon._handle(Control("frame", "coordinator", frame, "job-1"))
    assert daemon.counters.get("frame_before_manifest") == 200
    assert _lines(caplog) == ["a1 dropped a sealed frame of job 'job-1' sent before it started"] * 5

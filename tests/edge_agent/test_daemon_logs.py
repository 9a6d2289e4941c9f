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


def test_a_control_message_that_raises_is_counted_and_the_agent_goes_on(
    daemon: AgentDaemon, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a handler raises (here, a stand-in bug in the manifest's), the daemon's
    loop counts it, logs a few tracebacks and takes the next message."""

    def broken(msg: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(daemon, "_on_manifest", broken)
    coordinator = ControlCodec("coordinator")
    with caplog.at_level(logging.INFO, LOGGER):
        for _ in range(20):
            [frame] = coordinator.encode("manifest", "job-1", "a1", {}, sign=False)
            daemon._take(Control("frame", "coordinator", frame, "job-1"))
    assert daemon.counters.get("control_error") == 20
    traced = [r for r in caplog.records if r.name == LOGGER and r.exc_info]
    assert len(traced) == 5 and "RuntimeError: a bug" in caplog.text


def test_an_ack_whose_round_is_not_an_integer_is_refused(
    daemon: AgentDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    from fedring.edge_agent.running import Running
    from fedring.edge_agent.worker import Segment

    seg = Segment(job="job-1", epoch=3, members=["a1", "a2"], start_round=0,
                  params_sha256="", head="a1")  # fmt: skip
    daemon.running = Running(seg, threading.Thread(), acked=4)
    coordinator = ControlCodec("coordinator")
    with caplog.at_level(logging.INFO, LOGGER):
        for rnd in ("7", 7.5, None, True):
            [frame] = coordinator.encode("ack", "job-1", "a1", {"epoch": 3, "round": rnd},
                                         sign=False)  # fmt: skip
            daemon._take(Control("frame", "coordinator", frame, "job-1"))
    assert daemon.counters.get("frame_malformed") == 4 and daemon.running.acked == 4
    assert "ack: round='7', not an integer" in caplog.text

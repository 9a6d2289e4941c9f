"""A pipeline stage's `model` messages it cannot take are counted each time and logged
a few times (`fedring.logs_limit`), however often they come: the stage's side of
tests/edge_agent/test_daemon_logs.py. Only the coordinator's frames reach a stage,
so the host is fed by hand, on a link that never connects."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.edge_agent.stage import StageHost
from fedring.pipeline.assignment import stage_state
from fedring.training.models import flat_sha256
from fedring.transport.mqtt import BrokerConfig, MqttLink
from fedring.wire.control import ControlCodec, ControlMessage

LOGGER = "fedring.edge_agent.stage"
Sent = list[tuple[str, str, dict[str, Any]]]


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno >= logging.WARNING]  # fmt: skip


def _host(sent: Sent) -> StageHost:
    counters = Counters()
    return StageHost("a0", ControlCodec("a0", counters=counters), counters,
                     lambda job, kind, doc, *_, **__: sent.append((job, kind, doc)),
                     data_dir=None, budget=None, allowed_modules=())  # fmt: skip


def _manifest(params_sha256: str) -> ControlMessage:
    """Stage 1 of 2 (the layers that hold parameters) of job j, for agent a0."""
    spec = JobSpec(agents=2, pipeline_stages=2)
    doc = {"mode": "pipeline", "key": "00" * 32, "job": "j", "epoch": 0,
           "spec": spec.resolved(), "stage": 1, "members": ["a1", "a0"], "starts": [0, 1],
           "boards": [["a1", 1.0, 1.0], ["a0", 1.0, 1.0]],
           "params_sha256": params_sha256}  # fmt: skip
    return ControlMessage("manifest", "j", "coordinator", 0, doc, b"", True)


def _model(rnd: int, blob: bytes) -> ControlMessage:
    return ControlMessage("model", "j", "coordinator", rnd, {"round": rnd}, blob, True)


@pytest.fixture
def link() -> MqttLink:
    return MqttLink(BrokerConfig.parse("mqtt://127.0.0.1:1"), "a0")


def test_models_of_torn_floats_are_counted_and_logged_a_few_times(
    link: MqttLink, caplog: pytest.LogCaptureFixture
) -> None:
    sent: Sent = []
    host = _host(sent)
    assert host.handle(_manifest("0" * 64), link)
    assert host.current is not None and sent == []
    with caplog.at_level(logging.INFO, LOGGER):
        for rnd in range(50):
            assert host.handle(_model(rnd, b"\x00" * 6), link)
    assert host.counters.get("model_unexpected") == 50
    got = _lines(caplog)
    assert len(got) == 5  # the burst; the rest waits for a summary a minute on
    assert got[0] == ("a0: a model of 6 bytes from coordinator for round 0, job j: not "
                      "whole float32 values; ignored")  # fmt: skip
    assert host.current is not None and sent == []  # the stage still waits for its model


def test_models_while_the_stage_runs_are_counted_and_logged_a_few_times(
    link: MqttLink, caplog: pytest.LogCaptureFixture
) -> None:
    sent: Sent = []
    host = _host(sent)
    host.handle(_manifest("0" * 64), link)
    assert host.current is not None
    state = stage_state(host.current.module)  # materialized from the seed: the same again
    host.handle(_manifest(flat_sha256(state)), link)
    try:
        blob = state.numpy().tobytes()
        host.handle(_model(0, blob), link)
        assert [kind for _, kind, _ in sent] == ["ack"]  # its thread waits for "go"
        with caplog.at_level(logging.INFO, LOGGER):
            for rnd in range(1, 31):
                assert host.handle(_model(rnd, blob), link)
        assert host.counters.get("model_unexpected") == 30
        got = _lines(caplog)
        assert len(got) == 5
        assert got[0] == (f"a0: a model of {len(blob)} bytes from coordinator for round 1, "
                          "job j: its stage runs; ignored")  # fmt: skip
    finally:
        host.halt("the test ends")
        host.join()

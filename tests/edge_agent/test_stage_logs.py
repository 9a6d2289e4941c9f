"""A pipeline stage's `model` messages it cannot take are counted each time and logged
a few times (`fedring.logs_limit`), however often they come: the stage's side of
tests/edge_agent/test_daemon_logs.py. Only the coordinator's frames reach a stage,
so the host is fed by hand, on a link that never connects."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

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


def _manifest(params_sha256: str, stage: int = 1) -> ControlMessage:
    """Stage 1 of 2 of job j for agent a0: the layers that hold parameters (stage 0 is
    the flatten alone)."""
    spec = JobSpec(agents=2, pipeline_stages=2)
    members = ["a1", "a0"] if stage == 1 else ["a0", "a1"]
    doc = {"mode": "pipeline", "key": "00" * 32, "job": "j", "epoch": 0,
           "spec": spec.resolved(), "stage": stage, "members": members, "starts": [0, 1],
           "boards": [[m, 1.0, 1.0] for m in members],
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


def test_the_empty_state_of_a_stage_without_parameters_is_taken(link: MqttLink) -> None:
    """The coordinator sends a flatten-only stage an empty model; `frombuffer` once
    raised on it, out of the daemon's loop."""
    sent: Sent = []
    host = _host(sent)
    host.handle(_manifest(flat_sha256(torch.zeros(0)), stage=0), link)
    assert host.current is not None and host.current.plan.stages[0].params == 0
    try:
        assert host.handle(_model(0, b""), link)
        assert [kind for _, kind, _ in sent] == ["ack"]
        assert host.counters.snapshot() == {}
    finally:
        host.halt("the test ends")
        host.join()

"""A message that makes a link's handler raise, sent in a loop, fills no log: each is
counted (``mqtt_callback_error``), the first few per (kind of topic, error) are logged
with their traceback, the rest in a summary line per interval, and the link keeps
reading. On a real Mosquitto."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest

from fedring.transport import topics
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig, MqttLink
from fedring.transport.mqtt_connection import topic_kind
from fedring.transport.mqtt_inbox import Inboxes
from tests.mqtt.conftest import MISSING
from tests.mqtt.test_log_flood import Flooder

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

LOGGER = "fedring.transport.mqtt"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(workdir=tmp_path_factory.mktemp("handler-errors")) as b:
        yield b


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_topic_kind_drops_the_ids() -> None:
    assert topic_kind(topics.inbox("j1", "a2", "mallory")) == "jobs/+/to"
    assert topic_kind(topics.broadcast("j1", "eve")) == "jobs/+/all"
    assert topic_kind(topics.status("a1")) == "agents/+/status"
    assert topic_kind("elsewhere/x") == "other"


def test_300_messages_that_make_the_handler_raise_give_300_counts_and_5_tracebacks(
    broker: Mosquitto, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def boom(_self: Inboxes, _reason: str, what: str, _size: int) -> None:
        """A bug deep in the handler: a frame for a job the link is not in raises."""
        calls.append(what)
        if what.endswith("/eve"):
            raise KeyError(what)
        raise ValueError(f"bug handling {what}")

    monkeypatch.setattr(Inboxes, "dropped", boom)
    link = MqttLink(BrokerConfig.parse(broker.url), "h1").connect()
    flooder = Flooder(broker.port, "flood-handler")
    try:
        flooder.await_online("h1")  # its subscriptions are live: none of the flood is lost
        with caplog.at_level(logging.ERROR, LOGGER):
            flooder.publish(topics.inbox("job-x", "h1", "mallory"), b"\x00" * 100, n=300)
            _wait(lambda: link.counters.get("mqtt_callback_error") >= 300, 20, "300 errors")
            # another error gets its own tracebacks, and paho's loop still reads
            flooder.publish(topics.inbox("job-x", "h1", "eve"), b"\x00", n=2)
            _wait(lambda: len(calls) >= 302, 10, "2 more messages handled")
        assert link.counters.get("mqtt_callback_error") == 302
        errors = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR]
        traced = [r for r in errors if r.exc_info is not None]
        assert len(errors) <= 8, [r.getMessage() for r in errors]
        kinds = [r.exc_info[1].__class__ for r in traced if r.exc_info is not None]
        assert kinds == [ValueError] * 5 + [KeyError] * 2  # 5 in full; a summary after 60 s
        assert errors[0].getMessage() == (
            "h1: error handling a message on fedring/v1/jobs/job-x/to/h1/mallory"
        )
        assert "bug handling" in caplog.text  # the traceback is in the log
    finally:
        flooder.close()
        link.close()

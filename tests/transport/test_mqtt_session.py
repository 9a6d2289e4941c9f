"""`mqtt_session.Session.step_back` without a broker: a link steps back only for another
live holder of its id, seen in a retained presence (issue 27)."""

from __future__ import annotations

import json
import logging

import paho.mqtt.client as mqtt
import pytest

from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import LinkStats
from fedring.transport.mqtt_broker import BrokerConfig
from fedring.transport.mqtt_connection import Connection
from fedring.transport.mqtt_session import Session


class FakeClient:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, bool]] = []
        self.disconnected = False

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        self.published.append((topic, payload, retain))

    def disconnect(self) -> None:
        self.disconnected = True


def _msg(state: str, session: str, *, retain: bool = True) -> mqtt.MQTTMessage:
    msg = mqtt.MQTTMessage(topic=topics.status("a1").encode())
    msg.payload = json.dumps({"state": state, "session": session}).encode()
    msg.retain = retain
    return msg


def _session(protocol: str = "3.1.1") -> tuple[Session, list[str]]:
    conn = Connection(BrokerConfig("127.0.0.1", 1883, protocol=protocol), "a1", None,  # type: ignore[arg-type]
                      Counters(), LinkStats())  # fmt: skip
    stopped: list[str] = []
    return Session(conn, lambda: stopped.append("beats")), stopped


def test_another_holders_retained_online_makes_the_link_step_back() -> None:
    session, stopped = _session()
    client, msg = FakeClient(), _msg("online", "theirs")
    session.step_back(client, msg)  # type: ignore[arg-type]
    assert session.conn.closed and stopped == ["beats"]
    assert "another process holds the id 'a1'" in session.taken_over
    assert client.published == [(msg.topic, msg.payload, True)] and client.disconnected
    assert session.conn.counters.get("id_taken_over") == 1


@pytest.mark.parametrize(
    "msg",
    [_msg("online", "theirs", retain=False), _msg("lost", "theirs"), _msg("offline", "theirs"),
     _msg("online", "")],
)  # fmt: skip
def test_nothing_but_another_sessions_retained_online_counts(msg: mqtt.MQTTMessage) -> None:
    session, stopped = _session()
    session.step_back(FakeClient(), msg)  # type: ignore[arg-type]
    assert not session.conn.closed and session.taken_over == "" and stopped == []


def test_our_own_presence_and_a_garbled_one_are_not_a_takeover() -> None:
    session, _ = _session()
    session.step_back(FakeClient(), _msg("online", session.conn.session))  # type: ignore[arg-type]
    garbled = _msg("online", "x")
    garbled.payload = b"[" * 5000
    session.step_back(FakeClient(), garbled)  # type: ignore[arg-type]
    assert not session.conn.closed


def test_under_mqtt5_only_a_resumed_session_steps_back() -> None:
    """A restarted process's first MQTT 5 connect finds its dead predecessor's "online"."""
    session, _ = _session("5")
    session.step_back(FakeClient(), _msg("online", "dead"))  # type: ignore[arg-type]
    assert not session.conn.closed
    session.conn.resumed = True
    session.step_back(FakeClient(), _msg("online", "live"))  # type: ignore[arg-type]
    assert session.conn.closed


def test_an_error_while_stepping_back_is_counted_and_its_traceback_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Raised on paho's thread it would stop the network loop: each is counted, and the
    log holds a few tracebacks (`Connection.errors`), not one per message."""

    class Refusing(FakeClient):
        def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
            raise RuntimeError("the client is closing")

    session, _ = _session()
    with caplog.at_level(logging.ERROR, "fedring.transport.mqtt"):
        for _ in range(30):
            session.conn.closed = False  # as if it came back each time
            session.step_back(Refusing(), _msg("online", "theirs"))  # type: ignore[arg-type]
    assert session.conn.counters.get("mqtt_callback_error") == 30
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert 1 <= len(tracebacks) <= 5, len(tracebacks)
    assert tracebacks[0].getMessage() == "a1: error reading its own presence"

"""What a capped broker and a 3.1.1-only broker do to one link, against the real brokers:
the packet-size arithmetic is exact at Mosquitto's ``max_packet_size``, big messages
arrive whole in parts whichever way the cap became known, a cap the link cannot know
is named in its log, and Aedes' refusal of MQTT 5 falls back to 3.1.1."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedring.transport.aedes import Aedes
from fedring.transport.base import Deadline, Delivery
from fedring.transport.mosquitto import AWS_IOT_CORE, Mosquitto
from fedring.transport.mqtt import BrokerConfig, MqttLink
from fedring.transport.mqtt_parts import packet_size
from tests.brokers.conftest import start_broker
from tests.mqtt.conftest import wait_for

CAP = AWS_IOT_CORE.max_packet_size


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    server = start_broker("aws", tmp_path_factory.mktemp("aws"))
    assert isinstance(server, Mosquitto)
    yield server
    server.stop()


def raw_client(url: str, name: str) -> mqtt.Client:
    cfg = BrokerConfig.parse(url)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5)
    client.connect(cfg.host, cfg.port)
    client.loop_start()
    return client


def test_a_packet_of_exactly_the_cap_passes_and_a_larger_one_is_refused(aws: Mosquitto) -> None:
    """`packet_size` counts the whole packet, as MQTT 5 defines the Maximum Packet Size.
    Mosquitto 2.0.11 leaves its 4-byte fixed header out of the count, so it refuses a
    packet only from cap + 5 bytes: our cut is 4 bytes more careful than it needs."""
    topic = "fedring/test/boundary"
    got: list[int] = []
    ready, dropped = threading.Event(), threading.Event()
    sub = raw_client(aws.url, "boundary-sub")
    sub.on_message = lambda _c, _u, msg: got.append(len(msg.payload))
    sub.on_subscribe = lambda *_: ready.set()
    sub.subscribe(topic, qos=1)
    pub = raw_client(aws.url, "boundary-pub")
    pub.on_disconnect = lambda *_: dropped.set()
    try:
        assert ready.wait(5)
        fits = max(n for n in range(CAP - 64, CAP) if packet_size(topic, n, v5=True) <= CAP)
        assert packet_size(topic, fits, v5=True) == CAP
        pub.publish(topic, bytes(fits), qos=1).wait_for_publish(5)
        wait_for(lambda: got == [fits], 5, "the packet of exactly the cap")
        pub.publish(topic, bytes(fits + 5), qos=1)
        assert dropped.wait(5), "the broker kept a client that sent cap + 5 bytes"
        assert got == [fits]
    finally:
        for client in (sub, pub):
            client.loop_stop()
            client.disconnect()


@pytest.mark.parametrize("query", ["?protocol=auto", "?max_message=128k"])
def test_a_message_over_the_cap_arrives_whole_in_parts(aws: Mosquitto, query: str) -> None:
    """MQTT 5 reads the cap in the CONNACK; 3.1.1 takes it from the URL."""
    cfg = BrokerConfig.parse(aws.url + query)
    sender, receiver = (MqttLink(cfg, n, job="j").connect() for n in ("s1", "r1"))
    try:
        assert sender._conn.max_message == CAP and sender._conn.v5 == (query == "?protocol=auto")
        inbox = receiver.endpoint("j")
        data = os.urandom(700_000)
        sender.endpoint("j").send("r1", data, Deadline.after(10))
        deadline = Deadline.after(15)
        while not isinstance(got := inbox.recv(deadline), Delivery):
            pass
        assert got == Delivery("s1", data)
        assert sender.counters.get("mqtt_parts_sent") == 6
        assert receiver.counters.get("mqtt_part_refused") == 0
    finally:
        sender.close()
        receiver.close()


def test_a_cap_the_link_cannot_know_is_named_in_its_log(
    aws: Mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    """MQTT 3.1.1 and no ?max_message: the broker drops the link at the big packet; the
    link says which option gives the cap, rather than reconnecting in silence."""
    link = MqttLink(BrokerConfig.parse(aws.url), "blind", job="j").connect()
    try:
        link.send_to("j", "nobody", bytes(300_000), Deadline.after(5))
        wait_for(lambda: link.counters.get("mqtt_drop_after_large") == 1, 10, "the drop")
        assert "?max_message=128k" in caplog.text and "packet of 300" in caplog.text
    finally:
        link.kill()


def test_aedes_refuses_mqtt5_and_auto_falls_back_to_3_1_1(tmp_path: Path) -> None:
    server = start_broker("aedes", tmp_path)
    assert isinstance(server, Aedes)
    try:
        link = MqttLink(BrokerConfig.parse(server.url + "?protocol=auto"), "a1").connect()
        assert not link._conn.v5 and link.wait_connected(Deadline.after(5))
        link.close()
        with pytest.raises(Exception, match="Unsupported protocol version"):
            MqttLink(BrokerConfig.parse(server.url + "?protocol=5"), "a2").connect()
    finally:
        server.stop()

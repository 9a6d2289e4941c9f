"""`MqttLink` against a real Mosquitto: presence, delivery, restarts, limits, errors."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from fedring.transport.base import Deadline, Delivery, MembershipEvent, TransportTimeout
from fedring.transport.mosquitto import Mosquitto, free_port
from fedring.transport.mqtt import BrokerConfig, BrokerUnreachable, MqttLink
from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")


@pytest.fixture
def broker(tmp_path) -> Iterator[Mosquitto]:  # type: ignore[no-untyped-def]
    with Mosquitto(persistence=True, workdir=tmp_path / "b") as b:
        yield b


def _next(link: MqttLink, deadline: float = 10.0) -> Delivery | MembershipEvent:
    return link.endpoint("j").recv(Deadline.after(deadline))


def _wait_peer(link: MqttLink, peer: str) -> None:
    deadline = Deadline.after(5)
    while peer not in link.peers():
        assert not deadline.expired, f"{link.me} never saw {peer}"
        time.sleep(0.02)


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_frames_arrive_with_the_sender_named_by_the_topic(broker: Mosquitto, protocol) -> None:  # type: ignore[no-untyped-def]
    cfg = BrokerConfig.parse(broker.url, protocol=protocol)
    a, b = MqttLink(cfg, "a").connect(), MqttLink(cfg, "b").connect()
    try:
        _wait_peer(a, "b")
        a.endpoint("j").send("b", b"payload", Deadline.after(5))
        a.endpoint("other").send("b", b"elsewhere", Deadline.after(5))
        items = [_next(b) for _ in range(2)]
        frames = [i for i in items if isinstance(i, Delivery)]
        while not frames:
            item = _next(b)
            frames = [item] if isinstance(item, Delivery) else []
        assert frames == [Delivery("a", b"payload")]
        assert a.stats.bytes_sent == len(b"payload") + len(b"elsewhere")
    finally:
        a.close()
        b.close()


def test_a_killed_peer_is_lost_within_one_and_a_half_keepalives(broker: Mosquitto) -> None:
    cfg = BrokerConfig.parse(broker.url, keepalive=5)
    a, b = MqttLink(cfg, "a").connect(), MqttLink(cfg, "b").connect()
    try:
        _wait_peer(a, "b")
        start = time.monotonic()
        b.kill()
        while True:
            item = _next(a)
            if isinstance(item, MembershipEvent) and item.kind == "lost":
                break
        assert item.name == "b" and time.monotonic() - start <= 7.5
        assert "b" not in a.peers()
    finally:
        a.close()


def test_a_clean_close_is_left_not_lost(broker: Mosquitto) -> None:
    cfg = BrokerConfig.parse(broker.url)
    a, b = MqttLink(cfg, "a").connect(), MqttLink(cfg, "b").connect()
    try:
        _wait_peer(a, "b")
        b.close()
        kinds = []
        while "left" not in kinds:
            item = _next(a)
            if isinstance(item, MembershipEvent):
                kinds.append(item.kind)
        assert "lost" not in kinds
    finally:
        a.close()


def test_a_broker_restart_is_not_a_death_and_loses_no_frame(broker: Mosquitto) -> None:
    cfg = BrokerConfig.parse(broker.url)
    a, b = MqttLink(cfg, "a").connect(), MqttLink(cfg, "b").connect()
    try:
        _wait_peer(a, "b")
        for i in range(50):
            a.endpoint("j").send("b", b"%d" % i, Deadline.after(5))
        broker.restart()
        for i in range(50, 100):  # queued by paho until it reconnects
            a.endpoint("j").send("b", b"%d" % i, Deadline.after(5))
        got, events = set(), []
        deadline = Deadline.after(20)
        while len(got) < 100 and not deadline.expired:
            item = b.endpoint("j").recv(deadline)
            if isinstance(item, Delivery):
                got.add(int(item.data))
            else:
                events.append(item.kind)
        assert got == set(range(100))
        time.sleep(cfg.lost_grace_s * 5.5)  # a retained "lost" would be confirmed by now
        assert "lost" not in events and "a" in b.peers()
        assert a.counters.get("mqtt_reconnect") >= 1
    finally:
        a.close()
        b.close()


def test_the_outgoing_queue_is_bounded(broker: Mosquitto) -> None:
    cfg = BrokerConfig.parse(broker.url, max_queued=10)
    a, b = MqttLink(cfg, "a").connect(), MqttLink(cfg, "b").connect()
    try:
        _wait_peer(a, "b")
        broker.stop()
        with pytest.raises(TransportTimeout, match="stayed full"):
            for _ in range(100):
                a.endpoint("j").send("b", b"x" * 100, Deadline.after(0.5))
        assert a.counters.get("send_queue_full") == 1
    finally:
        a.kill()
        b.kill()


def test_no_broker_is_a_clear_error() -> None:
    cfg = BrokerConfig.parse(f"mqtt://127.0.0.1:{free_port()}", connect_timeout_s=2)
    with pytest.raises(BrokerUnreachable, match="is mosquitto running"):
        MqttLink(cfg, "a").connect()


@pytest.mark.parametrize("url", ["http://x:1", "mqtt://", "mqtt://h:notaport"])
def test_bad_broker_urls_name_the_option(url: str) -> None:
    with pytest.raises(ValueError, match="--broker"):
        BrokerConfig.parse(url)

"""A broker user who sends garbage in a loop fills no log: each refusal is counted,
the first few per (peer, reason) are logged in full, the rest in one summary line per
interval (`fedring.logs_limit`). On a real Mosquitto."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion

from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.compression import GroupTopK
from fedring.counters import Counters
from fedring.fleet import BoardTable
from fedring.fleet_watch import FleetReader
from fedring.transport import topics
from fedring.transport.base import Deadline
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig, MqttLink
from fedring.transport.mqtt_parts import split_message
from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(workdir=tmp_path_factory.mktemp("log-flood")) as b:
        yield b


class Flooder:
    """A bare paho client that publishes what it is given, QoS 1."""

    def __init__(self, port: int, name: str) -> None:
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name)
        self.online: set[str] = set()
        self.c.on_message = lambda _c, _u, m: self.online.add(m.topic)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def await_online(self, link: str) -> None:
        """Until `link`'s retained status is seen. A link subscribes before it publishes
        that status, and the broker takes one client's packets in order: a message sent
        after this reaches its subscriptions (CI once lost the first of a flood sent
        right after `connect`)."""
        self.c.subscribe(topics.status(link), qos=1)
        _wait(lambda: topics.status(link) in self.online, 10, f"{link} online")

    def publish(self, topic: str, payload: bytes, n: int = 1, retain: bool = False) -> None:
        infos = [self.c.publish(topic, payload, qos=1, retain=retain) for _ in range(n)]
        for info in infos:
            info.wait_for_publish(10)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def warnings_from(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == logger and r.levelno >= logging.WARNING]  # fmt: skip


def test_500_garbage_frames_give_500_counts_and_a_few_log_lines(
    broker: Mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = BrokerConfig.parse(broker.url, max_inbox_items=1000)
    link = MqttLink(cfg, "g1").connect()
    counters = Counters()
    channel = PeerChannel(link.endpoint("job-g"), "job-g", counters=counters)
    flooder = Flooder(broker.port, "flood-frames")
    try:
        flooder.await_online("g1")
        with caplog.at_level(logging.WARNING, "fedring.collective.channel"):
            flooder.publish(topics.inbox("job-g", "g1", "mallory"), b"\x00" * 100, n=500)
            deadline = time.monotonic() + 20
            while counters.get("frame_bad_version") < 500 and time.monotonic() < deadline:
                with pytest.raises(CollectiveError):  # no g2: each wait ends
                    channel.recv("g2", round=0, step=0, phase="rs", deadline=Deadline.after(0.5))
        assert counters.get("frame_bad_version") == 500
        got = warnings_from(caplog, "fedring.collective.channel")
        assert 1 <= len(got) <= 6, got  # 5 in full; a summary only once 60 s have passed
        assert all("from mallory" in line for line in got[:5])
    finally:
        flooder.close()
        link.close()


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_an_evicted_early_payload_is_logged_with_its_sender(
    broker: Mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = BrokerConfig.parse(broker.url)
    g3, g4 = MqttLink(cfg, "g3").connect(), MqttLink(cfg, "g4").connect()
    counters = Counters()
    rx = PeerChannel(g3.endpoint("job-s"), "job-s", counters=counters, max_stash=4)
    tx = PeerChannel(g4.endpoint("job-s"), "job-s")
    payload = GroupTopK(8, 2, "int8").compress(torch.ones(64))
    try:
        _wait(lambda: "g3" in g4.peers() and "g4" in g3.peers(), 5, "g3 and g4 online")
        for rnd in range(1, 11):  # ten rounds ahead of the one g3 waits for
            tx.send("g3", payload, round=rnd, step=0, phase="rs", deadline=Deadline.after(5))
        with caplog.at_level(logging.WARNING, "fedring.collective.channel"):
            while counters.get("stash_evicted") < 6:
                with pytest.raises(CollectiveError):
                    rx.recv("g4", round=0, step=0, phase="rs", deadline=Deadline.after(2))
        assert counters.get("stash_evicted") == 6
        got = warnings_from(caplog, "fedring.collective.channel")
        assert len(got) == 5  # the burst; the sixth waits for a summary
        assert got[0] == ("g3 dropped an early payload from g4 (round 1, step 0, rs): "
                          "its stash holds at most 4")  # fmt: skip
    finally:
        g4.close()
        g3.close()


def test_forged_beats_are_counted_each_and_logged_a_few_times(
    broker: Mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    watcher = MqttLink(BrokerConfig.parse(broker.url), "w-beats", watch=True).connect()
    flooder = Flooder(broker.port, "flood-beats")
    try:
        flooder.await_online("w-beats")
        with caplog.at_level(logging.WARNING, "fedring.transport.mqtt"):
            flooder.publish(topics.beat("ghost"), b"forged-session 5", n=200)
            _wait(lambda: watcher.counters.get("bad_beat") >= 200, 10, "200 bad beats")
        got = [line for line in warnings_from(caplog, "fedring.transport.mqtt")
               if "ghost" in line]  # fmt: skip
        assert watcher.counters.get("bad_beat") == 200
        assert len(got) == 5, got
        assert got[0] == ("w-beats: refused a beat of ghost: session 'forged-session', "
                          "its presence says None")  # fmt: skip
    finally:
        flooder.close()
        watcher.close()


def test_abandoned_part_messages_are_counted_and_logged_a_few_times(
    broker: Mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    """The joiner holds at most 64 incomplete messages: 100 first parts of messages
    that never finish abandon 36 of them."""
    link = MqttLink(BrokerConfig.parse(broker.url), "g5").connect()
    flooder = Flooder(broker.port, "flood-parts")
    topic = topics.inbox("job-p", "g5", "mallory")
    try:
        flooder.await_online("g5")
        with caplog.at_level(logging.WARNING, "fedring.transport.mqtt"):
            for msg_id in range(100):
                first = split_message(topic, bytes(1000), 200, msg_id)[0]
                flooder.publish(topic, first)
            _wait(lambda: link.counters.get("mqtt_part_abandoned") >= 36, 10, "36 abandoned")
        got = [line for line in warnings_from(caplog, "fedring.transport.mqtt")
               if "gave up" in line]  # fmt: skip
        assert link.counters.get("mqtt_part_abandoned") == 36
        assert len(got) == 5, got
        assert got[0].startswith("g5 gave up 1 incomplete multi-part message(s)")
        assert topic in got[0]
    finally:
        flooder.close()
        link.close()


def test_beats_under_a_bad_agent_id_are_counted_and_logged_a_few_times(
    broker: Mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    counters = Counters()
    reader_table = BoardTable(counters)
    reader = FleetReader(BrokerConfig.parse(broker.url), reader_table).start()
    flooder = Flooder(broker.port, "flood-topics")
    topic = f"{topics.ROOT}/agents/not an id!/beat"
    try:
        with caplog.at_level(logging.WARNING, "fedring.fleet_watch"):
            # the reader publishes nothing to wait for: a good board's beat, one at a
            # time until the reader lists the board, so the flood after it reaches a
            # live subscription (on another counter: a probe counted late would not do)
            def listed() -> bool:
                flooder.publish(topics.beat("probe"), b"s 5")
                return "probe" in {b.id for b in reader_table.boards(time.monotonic())}

            _wait(listed, 10, "the reader's subscription")
            flooder.publish(topic, b"s 5", n=100)
            _wait(lambda: counters.get("bad_topic") >= 100, 10, "100 bad topics")
        got = warnings_from(caplog, "fedring.fleet_watch")
        assert counters.get("bad_topic") == 100
        assert got == [f"a message on {topic!r}: not an agent id"] * 5
    finally:
        flooder.close()
        reader.close()

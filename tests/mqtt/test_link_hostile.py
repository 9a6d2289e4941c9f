"""`MqttLink` against a broker user who means harm, on a real Mosquitto (issue 27):
forged heartbeats, floods on jobs a link is not in, and a goodbye the broker reads
late."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedring.transport import topics
from fedring.transport.base import Deadline, MembershipEvent
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig, MqttLink
from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(workdir=tmp_path_factory.mktemp("hostile-link")) as b:
        yield b


class Spy:
    """A bare paho client: publishes what a hostile user would, reads retained topics."""

    def __init__(self, port: int, name: str = "spy") -> None:
        self.got: dict[str, bytes] = {}
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=name)
        self.c.on_message = lambda _c, _u, m: self.got.__setitem__(m.topic, bytes(m.payload))
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def publish(self, topic: str, payload: bytes) -> None:
        self.c.publish(topic, payload, qos=1).wait_for_publish(5)

    def retained(self, topic: str, timeout: float = 5.0) -> bytes:
        self.got.pop(topic, None)
        self.c.subscribe(topic, qos=1)
        deadline = time.monotonic() + timeout
        while topic not in self.got:
            assert time.monotonic() < deadline, f"nothing retained on {topic}"
            time.sleep(0.02)
        self.c.unsubscribe(topic)
        return self.got[topic]

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_forged_beat_with_a_tiny_keepalive_loses_no_live_peer(broker: Mosquitto) -> None:
    """A beat once carried its own keep-alive: ``"<session> 0.001"`` had a live agent
    taken for lost within 0.1 s. The limit now comes from the agent's presence."""
    cfg = BrokerConfig.parse(broker.url, keepalive=2)
    watcher = MqttLink(cfg, "w", watch=True).connect()
    agent = MqttLink(cfg, "a1").connect()
    spy = Spy(broker.port)
    try:
        _wait(lambda: "a1" in watcher.peers(), 5, "a1 online")
        time.sleep(1.0)  # a1's own beats have come in
        for _ in range(5):
            spy.publish(topics.beat("a1"), f"{agent.session} 0.001".encode())
        spy.publish(topics.beat("a1"), b"not-its-session 0.001")
        time.sleep(1.0)  # 1,000 of the forged keep-alives
        assert "a1" in watcher.peers()
        assert watcher.counters.get("peer_silent") == 0
        assert watcher.counters.get("bad_beat") >= 1  # the one with a session not a1's
        events = []
        while not watcher.control.empty():
            item = watcher.control.get_nowait()
            events += [item.event] if item.event is not None else []
        assert MembershipEvent("lost", "a1") not in events
    finally:
        spy.close()
        agent.close()
        watcher.close()


def test_a_hung_peer_is_still_lost_at_its_announced_keepalive(broker: Mosquitto) -> None:
    """The limit is the keep-alive the peer announced (1 s), not the watcher's own (4 s)."""
    watcher = MqttLink(BrokerConfig.parse(broker.url, keepalive=4), "w2", watch=True).connect()
    agent = MqttLink(BrokerConfig.parse(broker.url, keepalive=1), "a2").connect()
    try:
        _wait(lambda: "a2" in watcher.peers(), 5, "a2 online")
        time.sleep(1.0)
        agent._stop_beats.set()  # hung: connected, silent
        start = time.monotonic()
        _wait(lambda: "a2" not in watcher.peers(), 4, "a2 taken for lost")
        assert time.monotonic() - start < 1.25 * 4 - 1  # well before the watcher's own limit
    finally:
        agent.close()
        watcher.close()


def test_an_agent_hears_no_broadcast_of_a_job_it_is_not_in(broker: Mosquitto) -> None:
    """Agents subscribed to every job's broadcasts: a flood on any job's topic crossed
    every idle agent's link (and filled its queue where it named an old job)."""
    cfg = BrokerConfig.parse(broker.url)
    idle = MqttLink(cfg, "a3").connect()
    spy = Spy(broker.port, "flooder")
    try:
        for _ in range(50):
            spy.publish(topics.broadcast("someone-elses", "mallory"), bytes(10_000))
        spy.publish(topics.inbox("marker", "a3", "mallory"), b"last")  # after the flood
        _wait(lambda: idle.counters.get("inbox_other_job") >= 1, 5, "the marker")
        assert idle.stats.frames_received == 1  # the marker alone
        assert idle.queued_bytes == 0
    finally:
        spy.close()
        idle.close()


def test_a_finished_job_is_forgotten_and_its_flood_never_queued(broker: Mosquitto) -> None:
    """The coordinator's frame puts the agent in a job (and its broadcasts); once the job
    is left, a flood on its topics is neither delivered nor queued."""
    cfg = BrokerConfig.parse(broker.url, max_inbox_items=100)
    agent = MqttLink(cfg, "a4").connect()
    boss = MqttLink(cfg, topics.COORDINATOR).connect()
    spy = Spy(broker.port, "flooder2")
    try:
        _wait(lambda: "a4" in boss.peers(), 5, "a4 online")
        boss.send_to("old", "a4", b"manifest", Deadline.after(5))
        _wait(lambda: not agent.control.empty(), 5, "the coordinator's frame")
        time.sleep(0.3)  # the broadcast subscription made on its arrival
        spy.publish(topics.broadcast("old", "a1"), b"member frame")
        _wait(lambda: agent.queued_bytes > len(b"manifest"), 5, "the job's broadcast")
        agent.leave("old")
        time.sleep(0.3)  # the broker has the unsubscribe
        received = agent.stats.frames_received
        queued = agent.queued_bytes
        for _ in range(300):  # three times the queue's items
            spy.publish(topics.broadcast("old", "mallory"), bytes(100))
        for _ in range(300):
            spy.publish(topics.inbox("old", "a4", "mallory"), bytes(100))
        spy.publish(topics.inbox("marker", "a4", "mallory"), b"last")
        _wait(lambda: agent.stats.frames_received >= received + 301, 10, "the inbox flood")
        assert agent.stats.frames_received == received + 301  # no broadcast crossed the link
        assert agent.queued_bytes == queued  # nothing held
        assert agent.counters.get("inbox_full") == 0
        assert agent.counters.get("inbox_other_job") == 301
    finally:
        spy.close()
        boss.close()
        agent.close()


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_a_goodbye_the_broker_reads_late_still_leaves_offline(
    broker: Mosquitto, protocol: str
) -> None:
    """Under load the broker may read the session-clearing connect before the goodbye's
    DISCONNECT: it takes the open connection over and sends its will, ``lost``. Here the
    DISCONNECT never goes out at all; the retained status must still be the goodbye."""
    cfg = BrokerConfig.parse(broker.url, protocol=protocol, will_delay_s=0)
    link = MqttLink(cfg, f"late-{protocol.replace('.', '')}").connect()
    spy = Spy(broker.port, f"reader-{protocol}")
    try:
        link._client.disconnect = lambda **_: None  # type: ignore[method-assign,union-attr]
        link.close("offline")
        time.sleep(0.5)  # the takeover's will, if any, is out
        doc = json.loads(spy.retained(topics.status(link.me)))
        assert doc["state"] == "offline", doc
        assert doc["session"] == link.session
    finally:
        spy.close()


def test_watchers_see_a_clean_goodbye_as_left(broker: Mosquitto) -> None:
    """The will of the takeover may reach a watcher, but the goodbye follows within the
    watcher's grace for a "lost": it sees the peer leave, not die."""
    watcher = MqttLink(BrokerConfig.parse(broker.url), "w3").connect()
    cfg = BrokerConfig.parse(broker.url, will_delay_s=0)
    try:
        link = MqttLink(cfg, "late-w").connect()
        _wait(lambda: "late-w" in watcher.peers(), 5, "late-w online")
        link._client.disconnect = lambda **_: None  # type: ignore[method-assign,union-attr]
        link.close("offline")
        time.sleep(1.0)  # past the watcher's 0.25 s grace for a "lost"
        events = []
        while not watcher.control.empty():
            item = watcher.control.get_nowait()
            if item.event is not None and item.src == "late-w":
                events.append(item.event.kind)
        assert events == ["joined", "left"], events
    finally:
        watcher.close()


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_a_process_restarted_at_once_is_not_taken_for_another_holder_of_its_id(
    broker: Mosquitto, protocol: str
) -> None:
    """A link steps back when another live process holds its id (`taken_over`), but a
    board restarted within the will's delay finds its dead predecessor's "online" still
    retained (MQTT 5 resumes the session and cancels the will): that is no holder."""
    cfg = BrokerConfig.parse(broker.url, protocol=protocol)
    me = f"restart-{protocol.replace('.', '')}"
    before = MqttLink(cfg, me).connect()
    time.sleep(0.3)
    before.kill()
    after = MqttLink(cfg, me).connect()
    try:
        time.sleep(1.0)  # its own presence, as retained, has come back to it
        assert after.taken_over == ""
        assert after.counters.get("id_taken_over") == 0
    finally:
        after.close()

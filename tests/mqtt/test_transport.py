"""`MqttLink` against a real Mosquitto: presence, delivery, restarts, limits, errors."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

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


@contextlib.contextmanager
def _pair(cfg: BrokerConfig, first: str, second: str) -> Iterator[tuple[MqttLink, MqttLink]]:
    """Two connected links, both closed however the test ends."""
    a, b = MqttLink(cfg, first).connect(), MqttLink(cfg, second).connect()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _wait_peer(link: MqttLink, peer: str) -> None:
    deadline = Deadline.after(5)
    while peer not in link.peers():
        assert not deadline.expired, f"{link.me} never saw {peer}"
        time.sleep(0.02)


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_frames_arrive_with_the_sender_named_by_the_topic(broker: Mosquitto, protocol) -> None:  # type: ignore[no-untyped-def]
    cfg = BrokerConfig.parse(broker.url, protocol=protocol)
    with _pair(cfg, "a", "b") as (a, b):
        b.endpoint("j")  # b is in job "j" only: a link holds frames of its jobs alone
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
        _received(b, 2)
        assert b.counters.get("inbox_other_job") == 1  # "elsewhere" was never held



@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_a_link_hears_a_jobs_broadcasts_once_the_broker_confirmed_its_subscription(
    broker: Mosquitto, protocol: str
) -> None:
    """`hears`: False before the job is joined and after it is left, True once its
    SUBACK came; a broadcast published after it then always arrives (the start barrier)."""
    cfg = BrokerConfig.parse(broker.url, protocol=protocol)
    with _pair(cfg, "a", "b") as (a, b):
        assert not b.hears("j", Deadline.after(0.2))  # never joined: nothing to wait for
        b.join("j")
        assert b.hears("j", Deadline.after(5))
        a.broadcast_to("j", b"round 0", Deadline.after(5))
        item = _next(b)
        while isinstance(item, MembershipEvent):  # a's presence may come first
            item = _next(b)
        assert item == Delivery("a", b"round 0")
        b.leave("j")
        assert not b.hears("j", Deadline.after(0.2))


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
    with _pair(cfg, "a", "b") as (a, b):
        b.endpoint("j")
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
        time.sleep(cfg.lost_grace_s * 2)  # a fresh "lost" would be confirmed by now
        assert "lost" not in events and "a" in b.peers()
        assert a.counters.get("mqtt_reconnect") >= 1



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


def _received(link: MqttLink, frames: int) -> None:
    deadline = Deadline.after(10)
    while link.stats.frames_received < frames:
        assert not deadline.expired, f"{link.me} got {link.stats.frames_received} of {frames}"
        time.sleep(0.02)


def test_an_idle_link_holds_no_frame_of_a_job_it_is_not_in(broker: Mosquitto) -> None:
    cfg = BrokerConfig.parse(broker.url)
    # Any agent may publish to jobs/+/to/a2/<itself> under the ACL.
    with _pair(cfg, "a2", "x") as (idle, x):
        for _ in range(100):
            x.send_to("bogus", "a2", bytes(200_000), Deadline.after(5))
        _received(idle, 100)
        assert idle.queued_bytes == 0
        assert idle.counters.get("inbox_other_job") == 100



def test_incoming_queues_are_bounded_in_bytes(broker: Mosquitto) -> None:
    cfg = BrokerConfig.parse(broker.url, max_inbox_bytes=1_000_000)
    with _pair(cfg, "a2", "x") as (slow, x):
        slow.endpoint("j")  # in the job, but nobody reads
        for _ in range(20):
            x.send_to("j", "a2", bytes(200_000), Deadline.after(5))
        _received(slow, 20)
        assert slow.queued_bytes == 1_000_000  # five frames
        assert slow.counters.get("inbox_full") == 15



def test_a_peer_reconnecting_after_a_broker_restart_is_not_lost(broker: Mosquitto) -> None:
    """The restart sends a's will ("lost", queued in b's session); b comes back within
    ~2 s, a only after 4 s: longer than a fresh will's grace, shorter than a restart's."""
    cfg = BrokerConfig.parse(broker.url)
    a, b = MqttLink(cfg, "a").connect(), MqttLink(cfg, "b").connect()
    try:
        _wait_peer(b, "a")
        assert a._client is not None
        a._client.reconnect_delay_set(4, 4)
        broker.restart(pause=0.5)
        deadline = Deadline.after(15)
        while a.counters.get("mqtt_reconnect") < 1 or b.counters.get("mqtt_reconnect") < 1:
            assert not deadline.expired, "a link did not reconnect"
            time.sleep(0.05)
        time.sleep(1.0)  # a's "online" reaches b and clears any pending "lost"
        events = []
        while True:
            try:
                item = b.endpoint("j").recv(Deadline.after(0.01))
            except TransportTimeout:
                break
            events.append(item)
        assert MembershipEvent("lost", "a") not in events, events
        assert "a" in b.peers()
    finally:
        a.close()
        b.close()


HUNG = """
import sys, time
from fedring.transport.mqtt import BrokerConfig, MqttLink
MqttLink(BrokerConfig.parse(sys.argv[1], keepalive=int(sys.argv[2])), "hung").connect()
print("up", flush=True)
time.sleep(60)
"""


def test_a_hung_peer_is_lost_as_soon_as_the_broker_sends_its_will(broker: Mosquitto) -> None:
    """SIGSTOP: only the broker's keep-alive check (1.5 x 2 s after the last packet, run
    every 5 s by Mosquitto 2.0) sees it; the link must add no more than its short grace."""
    a = MqttLink(BrokerConfig.parse(broker.url, keepalive=2), "a").connect()
    wills: list[float] = []
    spy = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="spy")
    spy.on_message = lambda _c, _u, m: (
        json.loads(m.payload or b"{}").get("state") == "lost" and wills.append(time.monotonic())
    )
    spy.connect("127.0.0.1", broker.port)
    spy.subscribe("fedring/v1/agents/hung/status", qos=1)
    spy.loop_start()
    hung = subprocess.Popen([sys.executable, "-c", HUNG, broker.url, "2"], stdout=subprocess.PIPE)
    try:
        assert hung.stdout is not None and hung.stdout.readline() == b"up\n"
        _wait_peer(a, "hung")
        stopped = time.monotonic()
        hung.send_signal(signal.SIGSTOP)
        while True:
            item = _next(a, deadline=15)
            if item == MembershipEvent("lost", "hung"):
                break
        seen = time.monotonic()
        assert wills, "the spy never saw the will"
        assert seen - wills[0] <= 0.5  # our own confirmation delay
        assert seen - stopped <= 1.5 * 2 + 1 + 5 + 0.5  # 1.5 keep-alives (whole s) + check
    finally:
        hung.kill()
        hung.wait(5)
        spy.loop_stop()
        spy.disconnect()
        a.close()


def test_a_watcher_sees_a_hung_peer_within_1_5_keepalives_and_takes_it_back(
    broker: Mosquitto,
) -> None:
    """SIGSTOP at keep-alive 4: the broker alone calls it lost after 6 s plus up to 5 s
    (its check's period); a watching link (the coordinator) after 5 s of missed
    heartbeats. SIGCONT before the broker drops it: the same session is back."""
    watcher = MqttLink(BrokerConfig.parse(broker.url, keepalive=4), "w", watch=True).connect()
    hung = subprocess.Popen([sys.executable, "-c", HUNG, broker.url, "4"], stdout=subprocess.PIPE)
    try:
        assert hung.stdout is not None and hung.stdout.readline() == b"up\n"
        _wait_peer(watcher, "hung")
        assert _next(watcher) == MembershipEvent("joined", "hung")
        time.sleep(2.0)  # its first beats have come in
        stopped = time.monotonic()
        hung.send_signal(signal.SIGSTOP)
        while (item := _next(watcher, deadline=15)) != MembershipEvent("lost", "hung"):
            assert item != MembershipEvent("joined", "hung"), item
        seen = time.monotonic() - stopped
        assert 1.25 * 4 - 4 / 3 <= seen <= 1.5 * 4, seen
        assert watcher.counters.get("peer_silent") == 1
        assert "hung" not in watcher.peers()
        hung.send_signal(signal.SIGCONT)
        while (item := _next(watcher, deadline=5)) != MembershipEvent("joined", "hung"):
            assert item != MembershipEvent("lost", "hung"), item
        assert "hung" in watcher.peers()
    finally:
        hung.kill()
        hung.wait(5)
        watcher.close()


def test_a_watcher_ignores_its_own_beats_and_counts_malformed_ones(broker: Mosquitto) -> None:
    """The coordinator's link subscribes to every agent's beat, its own included: that
    is not a bad beat. One with no usable keep-alive is, and changes nothing."""
    from fedring.transport import topics

    watcher = MqttLink(BrokerConfig.parse(broker.url, keepalive=2), "w", watch=True).connect()
    spy = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="spy")
    spy.connect("127.0.0.1", broker.port)
    spy.loop_start()
    try:
        time.sleep(2.5)  # about four of its own beats
        assert watcher.counters.get("bad_beat") == 0
        spy.publish(topics.beat("x"), b"s1 never", qos=1).wait_for_publish(5)
        deadline = time.monotonic() + 5
        while watcher.counters.get("bad_beat") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.counters.get("bad_beat") == 1
        assert "x" not in watcher.peers()
    finally:
        spy.loop_stop()
        spy.disconnect()
        watcher.close()


def test_the_link_probe_measures_a_round_trip_and_both_directions(broker: Mosquitto) -> None:
    from fedring.transport.mqtt_probe import down_bps

    link = MqttLink(BrokerConfig.parse(broker.url), "p").connect()
    try:
        probe = link.probe_link()
        assert 0 < probe["rtt_s"] < 1.0
        assert probe["up_bps"] > 0 and 0 < probe["down_bps"] <= probe["up_bps"]
        assert probe["link_bps"] > 0
    finally:
        link.close()
    assert link.probe_link() == {"rtt_s": 0.0, "up_bps": 0.0, "down_bps": 0.0, "link_bps": 0.0}
    # 256 KB in 64 KB pieces, up at 1 MB/s: the echo took piece/up + size/down
    assert down_bps(262_144, 65_536, 1e6, 65_536 / 1e6 + 262_144 / 5e5) == pytest.approx(5e5)
    assert down_bps(262_144, 65_536, 1e6, 0.3) == 1e6  # paced by the up link
    assert down_bps(262_144, 65_536, 1e6, 0.01) == 1e6  # noise: the up link's rate

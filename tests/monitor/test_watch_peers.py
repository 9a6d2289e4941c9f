"""An agent's link hears the coordinator's and its job's peers' presence only (issue 29),
against a real Mosquitto: no status fan-out to every agent, and a dead peer still seen.
In the monitor lane (presence, as `fedring fleet` watches it), beside the longer mqtt lane."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedring.transport import topics
from fedring.transport.base import Deadline, MembershipEvent, TransportTimeout
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig, Control, MqttLink
from fedring.transport.topics import TopicError
from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")
COORD = topics.COORDINATOR
ACL = Path(__file__).resolve().parents[2] / "examples" / "mosquitto.acl"


@pytest.fixture
def broker(tmp_path) -> Iterator[Mosquitto]:  # type: ignore[no-untyped-def]
    with Mosquitto(persistence=True, workdir=tmp_path / "b") as b:
        yield b


@contextlib.contextmanager
def _links(*links: MqttLink) -> Iterator[None]:
    try:
        yield
    finally:
        for link in links:
            link.close()


def _until(what: str, ok: Callable[[], bool], within: float = 10.0) -> None:
    deadline = Deadline.after(within)
    while not ok():
        assert not deadline.expired, what
        time.sleep(0.02)


def _acked(link: MqttLink) -> None:
    """A fence, two round trips through the broker on `link`'s one connection (in order):
    after the first, `link` has read every message the broker queued for it before (a
    will); after the second, the broker has read every packet `link` sent before, those
    sent in answer to the messages the first let in included (an UNSUBSCRIBE)."""
    for _ in range(2):
        info = link._client.publish(f"{topics.ROOT}/test/fence", b"", qos=1)  # type: ignore[union-attr]
        info.wait_for_publish(5.0)
        assert info.is_published(), f"{link.me}'s fence was never acknowledged"


def _events(link: MqttLink, within: float) -> list[MembershipEvent]:
    """The membership events on `link`'s data queue within `within` s."""
    found: list[MembershipEvent] = []
    deadline = Deadline.after(within)
    while not deadline.expired:
        try:
            item = link.endpoint("j").recv(Deadline.after(min(0.05, deadline.remaining())))
        except TransportTimeout:
            continue
        if isinstance(item, MembershipEvent):
            found.append(item)
    return found


def _heard(link: MqttLink) -> set[str]:
    """Whose membership changes reached `link`'s control queue so far."""
    names = set()
    while True:
        try:
            item: Control = link.control.get_nowait()
        except queue.Empty:
            return names
        if item.kind == "member":
            names.add(item.src)


def test_an_agent_hears_the_coordinator_and_its_peers_not_the_fleet(broker: Mosquitto) -> None:
    """Fails on the old links, which subscribed to every agent's status: `a` would hear
    `c` come and go. A wildcard an older process left in `a`'s persistent session is
    dropped on connect."""
    stale = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fedring-a", clean_session=False)
    stale.connect("127.0.0.1", broker.port)
    stale.subscribe(f"{topics.ROOT}/agents/+/status", qos=1)
    stale.loop_start()
    time.sleep(0.3)  # no SUBACK callback needed: the disconnect follows the SUBSCRIBE in order
    stale.disconnect()
    stale.loop_stop()
    cfg = BrokerConfig.parse(broker.url)
    coord = MqttLink(cfg, COORD, control_from=("*",), listen_hellos=True).connect()
    b = MqttLink(cfg, "b").connect()
    a = MqttLink(cfg, "a", statuses="peers").connect()
    with _links(a, b, coord):
        _until("a never saw the coordinator", lambda: COORD in a.peers())
        assert a.peers() == {COORD}  # b is online, but in no job with a
        a.watch_peers(["b", "a"])  # a ring of two: its own id is skipped
        _until("a never saw b once watched", lambda: "b" in a.peers())
        before = a.counters.get("status_unwatched")  # b's status queued in the old session
        c = MqttLink(cfg, "c").connect()
        c.close()
        seen: set[str] = set()
        _until("the coordinator never saw c come and go",
               lambda: bool(seen.update(_heard(coord))) or ("c" in seen and "c" not in
                                                             coord.peers()))  # fmt: skip
        assert a.peers() == {COORD, "b"}
        assert _heard(a) <= {COORD}  # b's arrival on watch is no news; c never reached it
        assert a.counters.get("status_unwatched") == before  # the stale wildcard was dropped
        a.watch_peers([])
        assert a.peers() == {COORD}  # b is forgotten, without an event
        _acked(a)  # the broker has read a's UNSUBSCRIBE
        before = a.counters.get("status_unwatched")
        b.kill()
        _until("the coordinator never saw b lost", lambda: "b" not in coord.peers())
        _acked(a)  # b's will, had the broker kept a's subscription, has reached a
        # `hears` would hide a will still sent (no event): the counter says the broker sent none
        assert a.counters.get("status_unwatched") == before
        assert [e for e in _events(a, 0.2) if e.name == "b"] == []


def test_a_peer_dropped_while_the_broker_is_away_is_not_heard_after_it(
    broker: Mosquitto,
) -> None:
    """The unsubscribe could not go out: our persistent session keeps b's topic at the
    broker until the reconnect drops it."""
    cfg = BrokerConfig.parse(broker.url)
    a = MqttLink(cfg, "a", statuses="peers").connect()
    b, spy = MqttLink(cfg, "b").connect(), MqttLink(cfg, "spy").connect()
    with _links(a, b, spy):
        a.watch_peers(["b"])
        _until("a never saw b", lambda: "b" in a.peers())
        broker.stop()
        _until("a never saw the broker go", lambda: not a._conn.connected.is_set())
        a.watch_peers([])
        broker.start()
        _until("the links did not reconnect", lambda: min(
            link.counters.get("mqtt_reconnect") for link in (a, b, spy)) >= 1, 20)  # fmt: skip
        _until("spy never saw b back", lambda: "b" in spy.peers())
        # A round trip of a's own: the broker has read a's UNSUBSCRIBE (sent before it, on
        # reconnect) and a has read what the broker queued for it before (b's "online"
        # may have beaten a's drop). CI once saw both a starved paho thread's strays here.
        assert a.probe_link(1024, 1024)["rtt_s"] > 0
        before = a.counters.get("status_unwatched")
        b.close()  # a goodbye the broker would hand a, had it kept b's topic
        _until("spy never saw b leave", lambda: "b" not in spy.peers())
        assert a.counters.get("status_unwatched") == before and a.peers() == set()


def test_a_watched_peer_killed_is_lost_within_one_and_a_half_keepalives(
    broker: Mosquitto,
) -> None:
    cfg = BrokerConfig.parse(broker.url, keepalive=5)
    a = MqttLink(cfg, "a", statuses="peers").connect()
    b = MqttLink(cfg, "b").connect()
    with _links(a):
        a.watch_peers(["b"])
        _until("a never saw b", lambda: "b" in a.peers())
        start = time.monotonic()
        b.kill()
        _until("b was not lost", lambda: MembershipEvent("lost", "b") in _events(a, 0.1), 7.5)
        assert time.monotonic() - start <= 7.5 and "b" not in a.peers()


def test_a_peer_gone_before_it_is_watched_is_seen_at_once(broker: Mosquitto) -> None:
    """A manifest may name a peer that died since: its retained will (or goodbye) arrives
    on subscribe and is news, not a broker restart's leftover (no 12 s restart grace)."""
    cfg = BrokerConfig.parse(broker.url)
    a = MqttLink(cfg, "a", statuses="peers").connect()
    b, c = MqttLink(cfg, "b").connect(), MqttLink(cfg, "c").connect()
    spy = MqttLink(cfg, "spy").connect()  # hears all: b's will is at the broker
    with _links(a, spy):
        _until("spy never saw b and c", lambda: {"b", "c"} <= spy.peers())
        b.kill()
        c.close()
        _until("b's will never came", lambda: not {"b", "c"} & spy.peers(), 10)
        start = time.monotonic()
        a.watch_peers(["b", "c"])
        gone = {MembershipEvent("lost", "b"), MembershipEvent("left", "c")}
        events: set[MembershipEvent] = set()
        while not gone <= events:
            assert time.monotonic() - start < 5, events
            events.update(_events(a, 0.1))
        assert time.monotonic() - start < cfg.restart_grace_s / 2
        assert a.peers() == set()  # no coordinator online here


def test_a_bad_peer_id_is_a_topic_error_naming_it(broker: Mosquitto) -> None:
    a = MqttLink(BrokerConfig.parse(broker.url), "a", statuses="peers").connect()
    with _links(a), pytest.raises(TopicError, match="peer 'x/#'"):
        a.watch_peers(["x/#"])
    with pytest.raises(ValueError, match="statuses='some'"):
        MqttLink(BrokerConfig.parse(broker.url), "a", statuses="some")  # type: ignore[arg-type]


def test_an_agent_watches_its_peers_under_the_example_acl(tmp_path: Path) -> None:
    """One subscription per status topic: the ACL's ``read agents/+/status`` allows each."""
    users = {COORD: "pw-c", "a1": "pw-1", "a2": "pw-2"}
    with Mosquitto(users=users, acl=ACL, workdir=tmp_path / "acl") as broker:

        def cfg(user: str) -> BrokerConfig:
            return BrokerConfig.parse(broker.url, username=user, password=users[user])

        coord = MqttLink(cfg(COORD), COORD, control_from=("*",), listen_hellos=True).connect()
        a1 = MqttLink(cfg("a1"), "a1", statuses="peers").connect()
        a2 = MqttLink(cfg("a2"), "a2", statuses="peers").connect()
        with _links(a1, a2, coord):
            a1.watch_peers(["a2"])
            _until("a1 never saw a2 and the coordinator", lambda: a1.peers() == {COORD, "a2"})
            a2.kill()
            _until("a1 never lost a2", lambda: a1.peers() == {COORD}, 10)


def test_a_watch_while_the_link_reconnects_is_neither_lost_nor_left_behind(
    broker: Mosquitto,
) -> None:
    """A watch that lands after a reconnect subscribed to the peers it knew, but before the
    link counts as connected (held there by pausing paho's thread in the up hook): b, new,
    was subscribed by neither; c, dropped, stayed subscribed until the next reconnect."""
    cfg = BrokerConfig.parse(broker.url)
    a = MqttLink(cfg, "a", statuses="peers").connect()
    b, c, spy = (MqttLink(cfg, who).connect() for who in ("b", "c", "spy"))
    with _links(a, b, c, spy):
        a.watch_peers(["c"])
        _until("a never saw c", lambda: "c" in a.peers())
        connected = a._presence.connected
        windows: list[bool] = []

        def in_the_window(reconnect: bool) -> None:  # paho's thread, after the SUBSCRIBE
            if reconnect and not windows:
                watch = threading.Thread(target=a.watch_peers, args=(["b"],))
                watch.start()
                watch.join(5.0)
                windows.append(not watch.is_alive())
            connected(reconnect)

        a._presence.connected = in_the_window  # type: ignore[method-assign]
        broker.stop()
        _until("a never saw the broker go", lambda: not a._conn.connected.is_set())
        broker.start()
        _until("a did not reconnect", lambda: a.counters.get("mqtt_reconnect") >= 1, 20)
        assert windows == [True]  # the watch ran in the window, and returned
        _until("a never saw b, watched as it reconnected", lambda: "b" in a.peers())
        _until("spy never saw c back", lambda: "c" in spy.peers(), 20)
        _acked(a)
        before = a.counters.get("status_unwatched")
        c.close()
        _until("spy never saw c leave", lambda: "c" not in spy.peers())
        _acked(a)  # c's goodbye, had the broker kept a's subscription, has reached a
        assert a.counters.get("status_unwatched") == before and a.peers() == {"b"}


@pytest.mark.parametrize(("protocol", "strays"), [("3.1.1", 1), ("5", 0)])
def test_a_restarted_agent_stops_hearing_its_crashed_predecessors_peers(
    broker: Mosquitto, protocol: str, strays: int
) -> None:
    """A crashed process leaves its per-peer subscriptions in its persistent session, and
    under MQTT 3.1.1 the next process with its id resumes that session (MQTT 5's first
    connect starts clean). The new process never watched b: the first status the stale
    subscription brings is unsubscribed, and the broker sends no more."""
    cfg = BrokerConfig.parse(f"{broker.url}?protocol={protocol}")
    spy = MqttLink(cfg, "spy").connect()
    b = MqttLink(cfg, "b").connect()
    old = MqttLink(cfg, "a", statuses="peers").connect()
    old.watch_peers(["b"])
    _until("the old a never saw b", lambda: "b" in old.peers())
    _acked(old)
    old.kill()
    _until("spy never saw the old a lost", lambda: "a" not in spy.peers())
    a = MqttLink(cfg, "a", statuses="peers").connect()
    with _links(a, spy):
        b.close()
        _until("spy never saw b leave", lambda: "b" not in spy.peers())
        _acked(a)
        first = a.counters.get("status_unwatched")  # b's goodbye (said twice, `Session.close`)
        assert strays <= first <= 2 * strays and a.peers() == set()
        b = MqttLink(cfg, "b").connect()  # the broker has read a's UNSUBSCRIBE: no more
        _until("spy never saw b back", lambda: "b" in spy.peers())
        b.close()
        _until("spy never saw b leave again", lambda: "b" not in spy.peers())
        _acked(a)
        assert a.counters.get("status_unwatched") == first and a.peers() == set()

"""`mqtt_routing.Router` without a broker: where each message goes, and which jobs'
topics a link subscribes to (never another job's broadcasts, never a wildcard)."""

from __future__ import annotations

from typing import Any

from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import Delivery, LinkStats
from fedring.transport.mqtt_broker import BrokerConfig
from fedring.transport.mqtt_connection import Connection
from fedring.transport.mqtt_inbox import Control, Inboxes
from fedring.transport.mqtt_routing import Router
from fedring.transport.mqtt_watch import StatusWatch

CFG = BrokerConfig("127.0.0.1", 1883)
COORD = topics.COORDINATOR


class FakeClient:
    """Records the subscriptions a router makes."""

    def __init__(self) -> None:
        self.subs: list[str] = []
        self.unsubs: list[str] = []
        self.mids: dict[str, int] = {}  # topic -> its SUBSCRIBE's message id, as paho's

    def subscribe(self, topic: Any, qos: int = 0, options: Any = None) -> tuple[int, int]:
        self.subs += [t for t, _q in topic] if isinstance(topic, list) else [topic]
        mid = len(self.mids) + 1
        self.mids[self.subs[-1]] = mid
        return 0, mid

    def unsubscribe(self, topic: str) -> None:
        self.unsubs.append(topic)


class Side:
    def __init__(self, me: str = "a1", job: str | None = "j", *, watch: bool = False,
                 hellos: bool = False) -> None:  # fmt: skip
        self.counters, self.stats = Counters(), LinkStats()
        self.conn = Connection(CFG, me, job, self.counters, self.stats)
        self.inboxes = Inboxes(me, 100, 1 << 20, self.counters)
        self.heard: list[tuple[str, object]] = []
        self.router = Router(
            self.conn, self.inboxes, self.stats, self.counters, control_from=(COORD,),
            listen_hellos=hellos, statuses=StatusWatch(self.conn, None, lambda *_: None),
            status=lambda who, p, r: self.heard.append(("status", (who, p, r))),
            beat=(lambda who, p: self.heard.append(("beat", (who, p)))) if watch else None,
            probe=lambda p: self.heard.append(("probe", p)),
        )  # fmt: skip

    def data(self) -> list[object]:
        return [self.inboxes.data.get_nowait() for _ in range(self.inboxes.data.qsize())]

    def control(self) -> list[Control]:
        box = self.inboxes.control
        return [box.get_nowait() for _ in range(box.qsize())]


def test_peer_frames_of_our_jobs_are_held_and_of_any_other_dropped() -> None:
    side = Side()
    side.router.route(topics.inbox("j", "a1", "a2"), b"ring")
    side.router.route(topics.inbox("other", "a1", "a2"), b"flood")
    assert side.data() == [("j", Delivery("a2", b"ring"))]
    assert side.counters.get("inbox_other_job") == 1
    assert side.stats.frames_received == 2 and side.stats.bytes_received == 9


def test_the_coordinators_first_frame_in_a_job_puts_us_in_it() -> None:
    side = Side(job=None)
    side.counters.add("inbox_full", 3)
    side.router.route(topics.inbox("new", "a1", COORD), b"manifest")
    assert side.control() == [Control("frame", COORD, b"manifest", "new")]
    assert "new" in side.router.jobs and side.router.joined_at["new"] == {"inbox_full": 3}
    side.router.route(topics.inbox("new", "a1", "a2"), b"ring")
    assert side.data() == [("new", Delivery("a2", b"ring"))]


def test_a_private_queue_takes_every_sender_of_its_job() -> None:
    side = Side()
    private = side.inboxes.open_private("star")
    side.router.route(topics.inbox("star", "a1", COORD), b"x")
    side.router.route(topics.broadcast("star", "a2"), b"y")
    assert [private.get_nowait(), private.get_nowait()] == [
        ("star", Delivery(COORD, b"x")), ("star", Delivery("a2", b"y"))]  # fmt: skip
    assert side.control() == [] and side.data() == []


def test_broadcasts_of_our_job_are_held_our_echo_and_other_jobs_dropped() -> None:
    side = Side()
    side.router.route(topics.broadcast("j", "a2"), b"all")
    side.router.route(topics.broadcast("j", "a1"), b"echo")
    side.router.route(topics.broadcast("done", "a2"), b"late")
    assert side.data() == [("j", Delivery("a2", b"all"))]
    assert side.counters.get("broadcast_echo") == 1
    assert side.counters.get("inbox_other_job") == 1


def test_agent_topics_go_to_presence_probe_and_a_watchers_beats() -> None:
    side, watcher = Side(), Side("coordinator", None, watch=True, hellos=True)
    for s in (side, watcher):
        s.router.route(topics.status("a2"), b"{}", retained=True)
        s.router.route(topics.beat("a2"), b"s 5")
        s.router.route(topics.probe(s.conn.me), b"rtt")
        s.router.route(topics.probe("a2"), b"not ours")
        s.router.route(topics.hello("a2"), b"hi")
        s.router.route(topics.metrics("j", "a2"), b"m")
    assert side.heard == [("status", ("a2", b"{}", True)), ("probe", b"rtt")]
    assert watcher.heard == [("status", ("a2", b"{}", True)), ("beat", ("a2", b"s 5")),
                             ("probe", b"rtt")]  # fmt: skip
    assert side.control() == [Control("hello", "a2", b"hi"), Control("metrics", "a2", b"m", "j")]


def test_a_link_subscribes_to_its_own_jobs_broadcasts_only() -> None:
    side, client = Side(), FakeClient()
    side.router.subscribe(client)  # type: ignore[arg-type]
    assert topics.job_broadcasts("j") in client.subs
    assert not any("/all/" in t and "/j/" not in t for t in client.subs), client.subs
    assert not any(t.endswith("/beat") or t.endswith("/hello") for t in client.subs)
    side.conn.client = client  # type: ignore[assignment]
    side.conn.connected.set()
    side.router.join("k")
    side.router.join("k")
    assert client.subs.count(topics.job_broadcasts("k")) == 1
    side.router.leave("k")
    assert client.unsubs == [topics.job_broadcasts("k")] and "k" not in side.router.jobs
    again = FakeClient()
    side.router.subscribe(again)  # type: ignore[arg-type]
    assert topics.job_broadcasts("k") not in again.subs


def test_a_jobs_broadcasts_are_heard_from_their_suback_on() -> None:
    """`heard`: the broker confirmed the job's subscription (its SUBACK, by message id);
    a refused one is counted and logged, and waits no longer; other SUBACKs are no job's."""
    side, client = Side(job=None), FakeClient()
    side.conn.client = client  # type: ignore[assignment]
    side.conn.connected.set()
    side.router.join("k")
    side.router.join("m")
    heard = side.router.heard
    assert not heard["k"].is_set() and not heard["m"].is_set()
    side.router.subscribed(999, True)  # an inbox's or a status's: no job's
    side.router.subscribed(client.mids[topics.job_broadcasts("k")], True)
    assert heard["k"].is_set() and not heard["m"].is_set()
    side.router.subscribed(client.mids[topics.job_broadcasts("m")], False)
    assert heard["m"].is_set() and side.counters.get("broadcast_subscribe_refused") == 1
    side.router.leave("k")
    assert "k" not in heard
    again = FakeClient()
    side.router.subscribe(again)  # type: ignore[arg-type]  # a reconnect: heard again at its SUBACK
    assert not heard["m"].is_set()
    side.router.subscribed(again.mids[topics.job_broadcasts("m")], True)
    assert heard["m"].is_set()


def test_a_watcher_subscribes_to_beats_and_the_coordinator_to_hellos() -> None:
    side, client = Side("coordinator", None, watch=True, hellos=True), FakeClient()
    side.router.subscribe(client)  # type: ignore[arg-type]
    assert f"{topics.ROOT}/agents/+/beat" in client.subs
    assert f"{topics.ROOT}/agents/+/hello" in client.subs
    assert not any("/all/" in t for t in client.subs)


def test_a_star_frame_before_its_endpoint_waits_for_the_endpoint() -> None:
    """A sampled star answers the first members' round 0 while a slower one still loads
    its shard: the coordinator's reply reached that agent's control loop (refused there
    as "bad_version", a compact frame) and the agent waited out its timeout."""
    side = Side(job=None)
    star = topics.star("j")
    side.router.route(topics.inbox(star, "a1", COORD), b"round 0's result")
    assert side.control() == []
    endpoint_queue = side.inboxes.open_private(star)  # what `endpoint(star, private=True)` does
    assert endpoint_queue.get_nowait() == (star, Delivery(COORD, b"round 0's result"))
    side.router.leave(star)  # the job is over: its star's queue goes with it
    assert star not in side.inboxes.private

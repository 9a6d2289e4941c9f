"""`mqtt_presence.Presence` without a broker: statuses, wills, and a watcher's heartbeats.

The events a real link would queue are collected from `emit`; time is the caller's
(`check_silences(now)`), so no test waits out a keep-alive.
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from fedring.counters import Counters
from fedring.transport.base import MembershipEvent
from fedring.transport.mqtt_broker import BrokerConfig
from fedring.transport.mqtt_presence import (
    BEATS_PER_KEEPALIVE,
    BUSY_MARGIN,
    MAX_BUSY_S,
    MIN_KEEPALIVE_S,
    SILENT_AFTER,
    Heartbeat,
    Presence,
    announced_keepalive,
    parse_beat,
)

CFG = BrokerConfig("127.0.0.1", 1883, keepalive=5, lost_grace_s=0.05, restart_grace_s=0.5)


class Seen:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, who: str, events: list[MembershipEvent]) -> None:
        self.events += [(e.kind, who) for e in events]


def _presence(cfg: BrokerConfig = CFG) -> tuple[Presence, Seen, threading.Event, Counters]:
    seen, up, counters = Seen(), threading.Event(), Counters()
    up.set()
    return Presence(cfg, "coordinator", counters, seen, up), seen, up, counters


def _status(state: str, session: str, **extra: object) -> bytes:
    return json.dumps({"state": state, "session": session, **extra}).encode()


def test_a_peer_joins_once_per_session_and_a_restart_is_a_loss_then_a_join() -> None:
    presence, seen, _, _ = _presence()
    presence.status("a1", _status("online", "s1", job="j"), retained=True)
    presence.status("a1", _status("online", "s1", job="j"), retained=False)  # QoS 1 twice
    assert seen.events == [("joined", "a1")]
    assert presence.peers_in("j") == {"a1": "s1"} and presence.peers_in("k") == {}
    presence.status("a1", _status("online", "s2"), retained=False)
    assert seen.events[1:] == [("lost", "a1"), ("joined", "a1")]


def test_a_goodbye_is_left_and_another_sessions_goodbye_changes_nothing() -> None:
    presence, seen, _, _ = _presence()
    presence.status("a1", _status("online", "s1"), retained=False)
    presence.status("a1", _status("offline", "old"), retained=True)  # a predecessor's
    assert presence.peers() == {"a1"}
    presence.status("a1", _status("offline", "s1"), retained=False)
    assert seen.events == [("joined", "a1"), ("left", "a1")] and presence.peers() == set()


def test_a_will_counts_only_after_its_grace_and_not_across_our_own_drop() -> None:
    presence, seen, up, _ = _presence()
    presence.status("a1", _status("online", "s1"), retained=False)
    presence.status("a1", _status("lost", "s1"), retained=False)
    assert seen.events == [("joined", "a1")]  # a broker going down sends every will
    time.sleep(CFG.lost_grace_s + 0.2)
    assert seen.events[-1] == ("lost", "a1") and presence.peers() == set()

    presence.status("a2", _status("online", "s2"), retained=False)
    presence.status("a2", _status("lost", "s2"), retained=False)
    presence.disconnected()  # we lost the broker meanwhile: the status will be re-read
    up.clear()
    time.sleep(CFG.lost_grace_s + 0.2)
    assert presence.peers() == {"a2"}


def test_a_retained_will_waits_for_the_peers_reconnect() -> None:
    presence, seen, _, _ = _presence()
    presence.status("a1", _status("online", "s1"), retained=False)
    presence.status("a1", _status("lost", "s1"), retained=True)  # maybe a broker restart's
    time.sleep(CFG.lost_grace_s + 0.1)
    assert presence.peers() == {"a1"}
    presence.status("a1", _status("online", "s1"), retained=False)  # it came back
    time.sleep(CFG.restart_grace_s)
    assert seen.events == [("joined", "a1")]


def test_unreadable_statuses_and_our_own_are_ignored() -> None:
    presence, seen, _, counters = _presence()
    presence.status("coordinator", _status("online", "x"), retained=True)
    presence.status("a1", b"[" * 2000, retained=True)
    presence.status("a1", b"not json", retained=True)
    assert seen.events == [] and counters.get("bad_status") == 2


def test_a_silent_peer_is_lost_at_its_announced_keepalive_not_one_a_beat_carries() -> None:
    presence, seen, _, counters = _presence()
    presence.status("a1", _status("online", "s1", keepalive=2), retained=False)
    presence.beat("a1", b"s1 0.001")  # a forged tiny keep-alive must not count
    now = time.monotonic()
    presence.check_silences(now + 1.0)
    assert presence.peers() == {"a1"}
    presence.check_silences(now + SILENT_AFTER * 2 + 0.1)
    assert presence.peers() == set() and counters.get("peer_silent") == 1
    presence.beat("a1", b"s1 2")  # it was hung, not dead
    assert seen.events == [("joined", "a1"), ("lost", "a1"), ("joined", "a1")]


def test_a_beat_that_says_its_sender_is_busy_extends_that_beats_silence_limit() -> None:
    """A board's beats wait behind its own sends on a slow uplink; its ``busy`` beat,
    sent ahead of a long send, says for how long (issue 29)."""
    presence, _, _, counters = _presence()
    presence.status("a1", _status("online", "s1", keepalive=2), retained=False)
    presence.beat("a1", b"s1 2 rss=1 busy=6.0")
    now = time.monotonic()
    presence.check_silences(now + SILENT_AFTER * 2 + 5.9)
    assert presence.peers() == {"a1"} and counters.get("peer_silent") == 0
    presence.check_silences(now + SILENT_AFTER * 2 + 6.1)
    assert presence.peers() == set() and presence.silent() == {"a1"}
    presence.beat("a1", b"s1 2")  # its send went through: back, and no longer busy
    now = time.monotonic()
    presence.check_silences(now + SILENT_AFTER * 2 + 0.1)
    assert presence.peers() == set() and counters.get("peer_silent") == 2


@pytest.mark.parametrize("field", [b"busy=-1", b"busy=nan", b"busy=inf", b"busy=lots",
                                   b"busy=%d" % (MAX_BUSY_S + 1)])  # fmt: skip
def test_a_busy_field_out_of_range_is_skipped_and_extends_nothing(field: bytes) -> None:
    assert parse_beat(b"s1 2 " + field).busy == 0.0 and parse_beat(b"s1 2 " + field).bad
    presence, _, _, counters = _presence()
    presence.status("a1", _status("online", "s1", keepalive=2), retained=False)
    presence.beat("a1", b"s1 2 " + field)
    presence.check_silences(time.monotonic() + SILENT_AFTER * 2 + 0.1)
    assert presence.peers() == set() and counters.get("bad_beat_field") == 1


class _Client:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def publish(self, topic: str, payload: bytes, qos: int) -> None:
        self.sent.append(payload)


class _Conn:
    """What `Heartbeat` reads of a connection: an uplink of 100 kB/s with `unacked` bytes
    not yet acknowledged by the broker."""

    def __init__(self, unacked: int = 0, up_bps: float = 100e3) -> None:
        self.cfg, self.me, self.session = BrokerConfig("127.0.0.1", 1883, keepalive=3), "a1", "s1"
        self.client, self.connected = _Client(), threading.Event()
        self.connected.set()
        self.up_bps, self.unacked = up_bps, unacked

    def unacked_bytes(self) -> int:
        return self.unacked


def test_a_send_long_on_the_uplink_goes_after_a_beat_that_says_how_long() -> None:
    conn = _Conn()
    heart = Heartbeat(conn, None)  # type: ignore[arg-type]
    period = 3 / BEATS_PER_KEEPALIVE
    heart.ahead(int(100e3 * period / BUSY_MARGIN / 2))  # short: its beats are barely late
    assert conn.client.sent == []
    conn.unacked = 50_000
    heart.ahead(400_000)
    [beat] = conn.client.sent
    assert beat.startswith(b"s1 3 rss=") and parse_beat(beat).busy == 6.8  # 1.5 x 4.5 s, up
    heart.ahead(10_000)  # covered by the wait the beat just announced: nothing more
    heart.ahead(800_000)  # past it: a new beat
    assert len(conn.client.sent) == 2 and parse_beat(conn.client.sent[1]).busy == 12.8


def test_an_unmeasured_uplink_announces_nothing() -> None:
    conn = _Conn(unacked=10**7, up_bps=0.0)
    heart = Heartbeat(conn, None)  # type: ignore[arg-type]
    heart.ahead(10**7)
    assert conn.client.sent == [] and heart.busy_s() == 0.0
    conn.up_bps = 1.0  # a thousandth of a bit a second: capped
    assert heart.busy_s() == MAX_BUSY_S


def test_beats_of_another_session_or_of_ourselves_do_not_count() -> None:
    presence, seen, up, counters = _presence()
    presence.status("a1", _status("online", "s1"), retained=False)
    presence.beat("a1", b"forged 5")
    presence.beat("a1", b"")
    presence.beat("coordinator", b"mine 5")
    assert counters.get("bad_beat") == 2
    presence.check_silences(time.monotonic() + 1e6)  # never beat with its session
    assert presence.peers() == {"a1"}
    presence.beat("a1", b"s1")
    up.clear()  # our own outage silences everyone: no one is lost for it
    presence.check_silences(time.monotonic() + 1e6)
    assert presence.peers() == {"a1"} and seen.events == [("joined", "a1")]


def test_a_reconnect_restarts_the_watch_clocks() -> None:
    presence, _, _, _ = _presence()
    presence.status("a1", _status("online", "s1", keepalive=1), retained=False)
    presence.beat("a1", b"s1")
    time.sleep(0.05)
    presence.connected(reconnect=True)  # beats sent while we were away never reached us
    presence.check_silences(time.monotonic() + SILENT_AFTER * 1 - 0.02)
    assert presence.peers() == {"a1"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 5.0), ("5", 5.0), (True, 5.0), (math.nan, 5.0), (math.inf, 5.0), (0, MIN_KEEPALIVE_S),
     (-3, MIN_KEEPALIVE_S), (30, 30.0), (1e9, 65535.0)],
)  # fmt: skip
def test_an_announced_keepalive_is_taken_within_what_a_broker_accepts(
    value: object, expected: float
) -> None:
    assert announced_keepalive(value, 5.0) == expected

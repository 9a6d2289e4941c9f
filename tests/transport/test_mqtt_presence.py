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
    MIN_KEEPALIVE_S,
    SILENT_AFTER,
    Presence,
    announced_keepalive,
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

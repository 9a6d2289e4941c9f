"""Whose presence a link hears: every agent's, or only the peers it needs (issue 29).

A coordinator, a rendezvous and a watcher hear every agent's retained status
(``agents/+/status``). An agent needs only the statuses of those it takes orders from
(the coordinator) and of the peers its current manifest names: with the wildcard on
every agent, the broker handed each status change, and each retained status on
subscribe, to every agent, N² messages as a fleet enrols (issue 29: at 1,000 protocol
agents enrolment took 25.6 s with it, 3.8 s without).

`StatusWatch` keeps that set: one subscription per peer, dropped when a new manifest no
longer names the peer. A peer's retained status arrives on subscribe, so one already
dead is seen as soon as it is watched. `hears` tells `Router.route` whose statuses to
pass on: one still in flight when its topic was dropped is not read.

The broker's set can still differ from ours: an UNSUBSCRIBE lost with a connection, or
a crashed process's subscriptions in the persistent session the next process with our
id resumes (MQTT 3.1.1; MQTT 5's first connect starts clean). A status we do not hear
is such a stray: `hears` unsubscribes its topic, so each costs at most one message.

Locking: `watch` runs on the owner's thread; `flush` and `topics` on paho's at each
(re)connect, `down` at each drop and `hears` for each status. The set of names is
replaced whole (a frozenset: atomic under the GIL, so `hears` reads it unlocked);
whether a change goes out at once or at the next connect, and the topics left to
unsubscribe, are decided under `_lock`. A (re)connect subscribes to `topics` before the
link counts as connected: a `watch` from `flush` on goes out at once (``_live``), or it
would reach the broker only at the next reconnect. A peer dropped between `topics` and
that SUBSCRIBE is subscribed again by it: its next status is a stray.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable

import paho.mqtt.client as mqtt

from fedring.transport import topics
from fedring.transport.mqtt_connection import Connection

EVERY_STATUS = f"{topics.ROOT}/agents/+/status"
# Topics unsubscribed on one connection past which a stray is only counted (by
# `Router.route`), not unsubscribed: strays of many ids come only from an old wildcard.
MAX_STRAYS = 1024

log = logging.getLogger("fedring.transport.mqtt")


class StatusWatch:
    """The statuses a link subscribes to: every agent's (``always`` None) or those of
    ``always`` (never dropped) plus the peers named by `watch`; our own is always heard
    (`Session.step_back` reads it). `changed` hears of each change (added, removed)
    before the new subscriptions go out: their retained statuses may follow at once."""

    def __init__(self, conn: Connection, always: Collection[str] | None,
                 changed: Callable[[frozenset[str], frozenset[str]], None]) -> None:  # fmt: skip
        self.conn, self.me, self._changed = conn, conn.me, changed
        self.every = always is None
        self._always = frozenset(always or ()) - {self.me}
        self.peers: frozenset[str] = self._always
        self._lock = threading.Lock()
        self._live = False  # this connection's SUBSCRIBE is made: changes go out at once
        # Dropped while we were away: a persistent session keeps them at the broker.
        self._unheard: set[str] = {EVERY_STATUS}  # an older process's wildcard, too
        self._dropped: set[str] = set()  # unsubscribed on this connection

    def hears(self, who: str) -> bool:
        """Whether `who`'s status is ours to read; one that is not is a stray (module
        docstring), whose topic is unsubscribed."""
        if self.every or who in self.peers:
            return True
        self._unsubscribe_stray(who)
        return False

    def topics(self) -> list[str]:
        """What to subscribe to on (re)connect."""
        if self.every:
            return [EVERY_STATUS]
        return [topics.status(self.me), *(topics.status(p) for p in sorted(self.peers))]

    def flush(self, client: mqtt.Client) -> None:
        """On (re)connect, before `topics` is subscribed: unsubscribe what was dropped while
        away (and any wildcard a previous process of ours left in our persistent
        session); from now on a `watch` goes out at once."""
        if self.every:
            return
        with self._lock:
            gone, self._unheard = sorted(self._unheard), set()
            self._dropped = set(gone)
            self._live = True
            if gone:
                client.unsubscribe(gone)

    def down(self) -> None:
        """The connection dropped: changes wait for the next `flush`."""
        with self._lock:
            self._live = False

    def watch(self, peers: Iterable[str]) -> None:
        """Hear `peers` (and ``always``) from now on, no one else. A peer's id is
        checked (`topics.check_id`); ours is skipped."""
        if self.every:
            return
        named = {topics.check_id("peer", p) for p in peers} - {self.me}
        wanted = frozenset(named) | self._always
        with self._lock:
            added, removed = wanted - self.peers, self.peers - wanted
            self.peers = wanted  # `hears` refuses the removed from here on
            if added or removed:
                self._changed(added, removed)
            new = {topics.status(p) for p in added}
            gone = sorted(topics.status(p) for p in removed)
            self._unheard -= new
            self._dropped -= new
            client = self.conn.client
            if not self._live or client is None:  # the next connect subscribes `peers`
                self._unheard.update(gone)
                return
            if new:
                client.subscribe([(t, 1) for t in sorted(new)])
            if gone:
                rc, _mid = client.unsubscribe(gone)
                (self._dropped if rc == mqtt.MQTT_ERR_SUCCESS else self._unheard).update(gone)

    def _unsubscribe_stray(self, who: str) -> None:
        """Unsubscribe `who`'s status, once a connection: a status in flight when `watch`
        dropped it needs nothing more, and a stray past `MAX_STRAYS` only its count."""
        topic = topics.status(who)
        with self._lock:
            client = self.conn.client
            stale = topic not in self._dropped and len(self._dropped) < MAX_STRAYS
            if who in self.peers or not (self._live and stale and client is not None):
                return  # watched again since `hears` read `peers`, or nothing to do
            self._dropped.add(topic)
            client.unsubscribe(topic)
        log.info("%s: unsubscribed from %s, a status it does not watch (a subscription the "
                 "broker kept)", self.me, topic)  # fmt: skip

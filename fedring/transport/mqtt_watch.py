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

Locking: `watch` runs on the owner's thread, `topics` and `flush` on paho's at each
(re)connect, `hears` on paho's for each status. The set of names is replaced whole (a
frozenset: atomic under the GIL); the topics left to unsubscribe are under `_lock`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable

import paho.mqtt.client as mqtt

from fedring.transport import topics
from fedring.transport.mqtt_connection import Connection

EVERY_STATUS = f"{topics.ROOT}/agents/+/status"


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
        # Dropped while we were away: a persistent session keeps them at the broker.
        self._unheard: set[str] = {EVERY_STATUS}  # an older process's wildcard, too

    def hears(self, who: str) -> bool:
        return self.every or who in self.peers

    def topics(self) -> list[str]:
        """What to subscribe to on (re)connect."""
        if self.every:
            return [EVERY_STATUS]
        return [topics.status(self.me), *(topics.status(p) for p in sorted(self.peers))]

    def flush(self, client: mqtt.Client) -> None:
        """On (re)connect: unsubscribe what was dropped while away (and any wildcard a
        previous process of ours left in our persistent session)."""
        if self.every:
            return
        with self._lock:
            gone, self._unheard = sorted(self._unheard), set()
        if gone:
            client.unsubscribe(gone)

    def watch(self, peers: Iterable[str]) -> None:
        """Hear `peers` (and ``always``) from now on, no one else. A peer's id is
        checked (`topics.check_id`); ours is skipped."""
        if self.every:
            return
        named = {topics.check_id("peer", p) for p in peers} - {self.me}
        wanted = frozenset(named) | self._always
        added, removed = wanted - self.peers, self.peers - wanted
        self.peers = wanted  # `hears` refuses the removed from here on
        if added or removed:
            self._changed(added, removed)
        client = self.conn.client
        up = client is not None and self.conn.connected.is_set()
        if added and up and client is not None:
            client.subscribe([(topics.status(p), 1) for p in sorted(added)])
        if removed:
            gone = [topics.status(p) for p in sorted(removed)]
            if up and client is not None:
                client.unsubscribe(gone)
            else:
                with self._lock:
                    self._unheard.update(gone)

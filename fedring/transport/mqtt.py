"""MQTT transport on paho-mqtt 2.x: a real broker between agents and the coordinator.

One `MqttLink` is one connection for one identity (an agent id or
``coordinator``). It publishes retained presence on ``agents/{id}/status`` with a
last-will that marks it ``lost`` (both name its job when it was given one:
`peers_in` finds a job's agents, which is how `fedring.connect` rendezvouses),
subscribes to its own inboxes and to everyone's presence (an agent's link, made with
``statuses="peers"``, to the coordinator's and its job's peers' only: `watch_peers`,
`mqtt_watch`), reconnects with
exponential backoff plus jitter, beats on ``agents/{id}/beat`` (a *watching* link, the
coordinator's, takes a peer whose beats stop for lost: a hung board), and keeps a
bounded outgoing queue (QoS 1;
MQTT 3.1.1 by default, 5 on request, see `BrokerConfig`; the session survives
reconnects and broker restarts, so queued frames are not lost).

Incoming messages go to one of two queues:

- **data**: ring frames from peers, as `Delivery(src, bytes)`, and presence changes
  as `MembershipEvent`s; `MqttLink.endpoint(job)` gives the `Endpoint` view that
  `PeerChannel` reads. A *private* endpoint (``endpoint(job, private=True)``) has
  a queue of its own and takes every frame of its job, the coordinator's
  included: a star's exchanges with the coordinator travel there, apart from the
  coordinator's control messages and from the ring.
- **control**: frames from the senders named in `control_from` (an agent listens
  to the coordinator there), hellos and metrics (the coordinator), and presence
  changes again, as `Control` items.

The sender of an inbox message is the topic's last level, which the broker's ACL
binds to the client's user name (see `topics`); QoS 1 may deliver twice, so
`PeerChannel` de-duplicates by (src, seq). A job's broadcasts
(``jobs/{job}/all/{src}``, `MqttEndpoint.broadcast`: one publish for every member)
go to the same data queue as its inbox frames; our own echo is dropped.

`MqttLink` is the face of a few collaborators, each with its own state and owner:

- `mqtt_broker`: `BrokerConfig`, the connect errors, TLS files and hints;
- `mqtt_connection`: the paho client, connect and reconnect, publishing; it tells
  the link of each (re)connect, drop and message through `Hooks`;
- `mqtt_session`: one process per id (stepping back for another holder) and the
  goodbye that clears the broker's session;
- `mqtt_presence`: who is online (statuses, wills, and a watcher's heartbeats), under
  its own lock, and our own heartbeat thread;
- `mqtt_routing` and `mqtt_inbox`: where each message goes, the jobs a link hears,
  and the bounded queues paho's thread fills; `mqtt_endpoint`: `MqttEndpoint`;
- `mqtt_probe`: the link's round trip and bandwidth, and the broker's Nagle check.

Threads: paho's network thread runs the connection's callbacks, which call into the
session, routing and presence; each module says which threads touch its state. Presence
takes its own lock (paho's thread, the heartbeat's, grace timers, callers of `peers`);
the queues are thread-safe; the rest is written by one thread and read by others (the
connection's events and ``closed`` flag, set once; the router's job sets).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable
from typing import Literal

import paho.mqtt.client as mqtt

from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import BROADCAST, Deadline, LinkStats
from fedring.transport.mqtt_broker import (
    BrokerConfig,
    BrokerRefused,
    BrokerTlsError,
    BrokerUnreachable,
    IdentityMismatch,
    check_identity,
)
from fedring.transport.mqtt_connection import Connection, Hooks
from fedring.transport.mqtt_endpoint import MqttEndpoint
from fedring.transport.mqtt_inbox import Control, Inboxes
from fedring.transport.mqtt_presence import SILENT_AFTER, Heartbeat, Presence
from fedring.transport.mqtt_probe import NAGLE_STALL_S, Probe
from fedring.transport.mqtt_routing import Router
from fedring.transport.mqtt_session import Session
from fedring.transport.mqtt_watch import StatusWatch

__all__ = [
    "NAGLE_STALL_S",
    "SILENT_AFTER",
    "BrokerConfig",
    "BrokerRefused",
    "BrokerTlsError",
    "BrokerUnreachable",
    "Control",
    "IdentityMismatch",
    "MqttEndpoint",
    "MqttLink",
    "check_identity",
]


class MqttLink:
    """One identity's connection to the broker."""

    def __init__(
        self,
        cfg: BrokerConfig,
        me: str,
        *,
        control_from: Collection[str] = (topics.COORDINATOR,),
        listen_hellos: bool = False,
        counters: Counters | None = None,
        job: str | None = None,  # announced in our presence (see `peers_in`)
        watch: bool = False,  # take a peer whose heartbeats stop for lost (the coordinator)
        # "all": every agent's presence (coordinator, rendezvous, watchers); "peers": that
        # of `control_from` and of the peers `watch_peers` names (an agent, issue 29)
        statuses: Literal["all", "peers"] = "all",
    ) -> None:
        self.cfg = cfg
        self.me = topics.check_id("id", me)
        check_identity(self.me, cfg.username)
        self.job = None if job is None else topics.check_id("job", job)
        self.stats = LinkStats()
        self.counters = counters or Counters()
        self._conn = Connection(cfg, self.me, self.job, self.counters, self.stats)
        self.session = self._conn.session
        self._inboxes = Inboxes(self.me, cfg.max_inbox_items, cfg.max_inbox_bytes, self.counters)
        self.control = self._inboxes.control
        self._presence = Presence(cfg, self.me, self.counters, self._inboxes.emit,
                                  self._conn.connected)  # fmt: skip
        self._heart = Heartbeat(self._conn, self._presence if watch else None)
        self._session = Session(self._conn, self._heart.stop.set)
        self._probe = Probe(self._conn)
        if statuses not in ("all", "peers"):
            raise ValueError(f"statuses={statuses!r} must be 'all' or 'peers'")
        always = [p for p in control_from if p != "*"] if statuses == "peers" else None
        self._statuses = StatusWatch(self._conn, always, self._presence.watch)
        self._router = Router(
            self._conn, self._inboxes, self.stats, self.counters, control_from=control_from,
            listen_hellos=listen_hellos, statuses=self._statuses, status=self._presence.status,
            beat=self._presence.beat if watch else None, probe=self._probe.seen.put,
        )  # fmt: skip

    # -- connection -----------------------------------------------------------

    def connect(self) -> MqttLink:
        """Connect (falling back to MQTT 3.1.1 if asked or needed) and announce presence."""
        hooks = Hooks(up=self._up, down=self._down, received=self._router.route,
                      own_status=self._session.step_back,
                      subscribed=self._router.subscribed)  # fmt: skip
        self._conn.connect(hooks)
        return self

    def _up(self, client: mqtt.Client, reconnect: bool) -> None:
        """Connected (on paho's thread, before our presence goes out): subscribe to all
        we hear, restart the watch's clocks and, the first time, start beating."""
        self._router.subscribe(client)
        self._presence.connected(reconnect)
        if self.cfg.heartbeat:
            self._heart.start()

    def _down(self) -> None:
        """The broker is gone for now (paho's thread): presence counts the drop, and the
        peers watched until the reconnect are subscribed by it (`StatusWatch.down`)."""
        self._presence.disconnected()
        self._statuses.down()

    def wait_connected(self, deadline: Deadline) -> bool:
        return self._conn.connected.wait(deadline.remaining())

    def close(self, state: str = "offline") -> None:
        """Say goodbye (retained status), then disconnect (see `Session.close`)."""
        self._session.close(state)

    def kill(self) -> None:
        """Drop the connection without a goodbye (tests): the broker sends our will."""
        self._session.kill()

    @property
    def taken_over(self) -> str:
        """Why this link stepped back for another holder of its id ("": never)."""
        return self._session.taken_over

    @property
    def _client(self) -> mqtt.Client | None:  # tests reach the paho client
        return self._conn.client

    @property
    def _stop_beats(self) -> threading.Event:  # tests hang a link: connected, silent
        return self._heart.stop

    # -- incoming -------------------------------------------------------------

    def _route(self, topic: str, payload: bytes, retained: bool = False) -> None:
        """Route one message as paho's thread would (the property tests' entry point)."""
        self._router.route(topic, payload, retained)

    def peers(self) -> frozenset[str]:
        return self._presence.peers()

    def silent_peers(self) -> frozenset[str]:
        """Peers a watching link took for lost when their beats stopped, though they never
        left (no goodbye, no will): they count as online again at their next beat."""
        return self._presence.silent()

    def peers_in(self, job: str) -> dict[str, str]:
        """Online peers whose presence names `job` (links made with ``job=``): id -> session."""
        return self._presence.peers_in(job)

    def watch_peers(self, peers: Iterable[str]) -> None:
        """Hear the presence of `peers` (and of `control_from`) from now on, no one
        else's: a link made with ``statuses="peers"`` (an agent) calls it with each
        manifest's members and with none once the job is done. The new peers' retained
        statuses arrive at once (one already gone is a "left" or "lost" event); those no
        longer named are forgotten, with no event. A link that hears all ignores it.
        A peer's bad id is a `TopicError` naming it."""
        self._statuses.watch(peers)

    def endpoint(self, job: str, *, private: bool = False) -> MqttEndpoint:
        """The job's `Endpoint`; from now on peers' frames of `job` are held for it.

        A `private` one has its own queue and takes the frames of every sender in
        `job`, those of `control_from` included, until it is closed.
        """
        endpoint = MqttEndpoint(self, job, self._inboxes, private=private)
        if private:
            self._router.hear_broadcasts(endpoint.job)
        elif endpoint.job not in self._router.jobs:
            self.join(endpoint.job)
        return endpoint

    def join(self, job: str) -> None:
        """Hold `job`'s frames from now on and subscribe to its broadcasts.

        An agent joins when the coordinator's first frame in the job reaches it (on
        paho's thread, before the manifest is even read); that its subscription is in
        place before a faster member broadcasts round 0 is ensured by the start barrier
        (`hears`), not by that head start. The counters at this moment are the job's baseline
        (`counters_since`): what is dropped while the job is set up is the job's."""
        self._router.join(job)

    def hears(self, job: str, deadline: Deadline) -> bool:
        """Wait until the broker confirmed our subscription to `job`'s broadcasts (its
        SUBACK): from then on every broadcast of the job reaches us. False if we never
        subscribed (never `join`ed) or the deadline passed first. An agent in a
        broadcast collective waits for it before it acknowledges its manifest, and the
        coordinator lets round 0 begin only once every member acknowledged (the start
        barrier, docs/design.md)."""
        heard = self._router.heard.get(job)
        return heard is not None and heard.wait(deadline.remaining())

    def leave(self, job: str) -> None:
        """Forget a finished job: its frames, broadcasts included, are dropped from now on
        (counted as ``inbox_other_job``), and the broker stops sending its broadcasts."""
        self._router.leave(job)

    def counters_since(self, job: str) -> dict[str, int]:
        """The counters when this link joined `job` (empty if it never did)."""
        return dict(self._router.joined_at.get(job, {}))

    def interrupt(self, channel_job: str) -> None:
        """Wake a `PeerChannel` of `channel_job` blocked in `recv`: it raises
        `CollectiveInterrupted` (channels of other jobs ignore it)."""
        self._inboxes.interrupt(channel_job)

    @property
    def queued_bytes(self) -> int:
        """Payload bytes waiting in the incoming queues (bounded by `max_inbox_bytes` each)."""
        return self._inboxes.queued_bytes

    def queue_depths(self) -> dict[str, int]:
        """Items waiting in each incoming queue: control, data, and a private one per job."""
        inboxes = self._inboxes
        private = {f"private:{job}": q.qsize() for job, q in inboxes.private.items()}
        return {"control": inboxes.control.qsize(), "data": inboxes.data.qsize(), **private}

    # -- outgoing -------------------------------------------------------------

    def publish(self, topic: str, data: bytes, deadline: Deadline, *, retain: bool = False) -> None:
        """QoS 1 publish; waits for room in the outgoing queue until `deadline`. A send
        long on our uplink goes after a beat that says so (`Heartbeat.ahead`)."""
        self._heart.ahead(len(data) + len(topic))
        self._conn.publish(topic, data, deadline, retain=retain)

    def send_to(self, job: str, dst: str, data: bytes, deadline: Deadline) -> None:
        self.publish(topics.inbox(job, dst, self.me), data, deadline)
        self.stats.per_peer_sent[dst] = self.stats.per_peer_sent.get(dst, 0) + len(data)

    def broadcast_to(self, job: str, data: bytes, deadline: Deadline) -> None:
        """One publish on `job`'s broadcast topic: the broker hands it to every member."""
        self.publish(topics.broadcast(job, self.me), data, deadline)
        self.stats.per_peer_sent[BROADCAST] = self.stats.per_peer_sent.get(BROADCAST, 0) + len(data)

    # -- measurements -----------------------------------------------------------

    def probe_bandwidth(self, total: int = 256 * 1024, piece: int = 64 * 1024) -> float:
        """Bytes per second of a round trip through the broker (0.0 if it fails)."""
        return self.probe_link(total, piece).get("link_bps", 0.0)

    def probe_link(self, total: int = 256 * 1024, piece: int = 64 * 1024) -> dict[str, float]:
        """This link to the broker, measured on the link's own probe topic (0.0: failed).

        ``rtt_s``: the best of three tiny messages there and back. ``up_bps``: `total`
        bytes published (QoS 1) until the broker acknowledged the last, less one round
        trip. ``link_bps``: the same bytes there and back. ``down_bps``: from the time
        the pieces took to come back (`mqtt_probe.down_bps`). ``broker_nagle``: 1.0 if
        the broker delays small messages (`check_broker_nagle`; 0.0 if not, or not
        checked; absent from a closed link's).
        """
        return self._probe.link(total, piece)

    def check_broker_nagle(self) -> bool | None:
        """Whether the broker Nagles small messages (`NAGLE_STALL_S`): if so, warn once
        naming the fix and count ``broker_nagle``. None: not checked.

        Two throwaway clients (ids ``fedring-{me}-nagle-*``, clean sessions) ping-pong
        on sub-topics of our probe topic; it takes well under 0.1 s on a good broker and
        at most `NAGLE_CHECK_S`. Skipped with a user name: a broker that makes each
        client id its user name (examples/mosquitto.conf) would hand them our session.
        Our own link acks at once (`quick_ack`), which hides most of the delay on
        Linux, but the broker still Nagles every other client it serves.
        """
        return self._probe.check_nagle()

    @property
    def broker_nagle(self) -> bool | None:
        """`check_broker_nagle`'s finding (None: unchecked)."""
        return self._probe.broker_nagle

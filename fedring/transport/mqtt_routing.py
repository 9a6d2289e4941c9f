"""Where each incoming MQTT message goes, and which jobs' topics a link hears at all.

`Router.route` reads the topic (the broker's ACL vouches for its sender level, see
`topics`) and hands the message to an inbox (`Inboxes`), to presence (statuses and
beats), or to the probe. `Router` also keeps the jobs a link is in: peers' frames of any
other job are dropped, and a link subscribes to the broadcasts of its own jobs only,
never to a wildcard, so a flood on another (or a finished) job's topics never reaches it.

Locking: `route` runs on paho's thread; `join` also runs there (the coordinator's first
frame in a job) and on the owner's, as does `leave`. The job sets are only added to and
discarded from (atomic under the GIL), and read by `route` one membership test at a
time; `subscribe` copies them. A broadcast subscription's message id is recorded under
``_subs_lock``, held across paho's ``subscribe`` so that its SUBACK (`subscribed`, on
paho's thread) always finds it: paho's ``subscribe`` takes none of the locks its
thread holds while it runs a callback.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

import paho.mqtt.client as mqtt
from paho.mqtt.subscribeoptions import SubscribeOptions

from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import Delivery, LinkStats
from fedring.transport.mqtt_connection import Connection
from fedring.transport.mqtt_inbox import Control, Inboxes
from fedring.transport.mqtt_watch import StatusWatch

log = logging.getLogger("fedring.transport.mqtt")


class Router:
    """A link's incoming side: the topics it subscribes to and where each message goes.

    ``control_from``: senders whose inbox frames go to the control queue (``*``: all);
    ``listen_hellos``: also hear every agent's hello and every job's metrics (the
    coordinator); `statuses`: whose presence we hear (`StatusWatch`); `status`, `beat`
    (a watcher's; None: beats are not heard) and `probe` take presence, heartbeats and
    our probe's echoes.
    """

    def __init__(self, conn: Connection, inboxes: Inboxes, stats: LinkStats,
                 counters: Counters, *, control_from: Collection[str], listen_hellos: bool,
                 statuses: StatusWatch,
                 status: Callable[[str, bytes, bool], None],
                 beat: Callable[[str, bytes], None] | None,
                 probe: Callable[[bytes], None]) -> None:  # fmt: skip
        self.conn, self.inboxes, self.stats, self.counters = conn, inboxes, stats, counters
        self.me = conn.me
        self._control_from = frozenset(control_from)
        self._listen_hellos = listen_hellos
        self._status, self._beat, self._probe = status, beat, probe
        self.statuses = statuses
        job = conn.job
        # Jobs whose peer frames we hold: ours, those with an open endpoint, and those the
        # coordinator (whose sender level only it may write) has sent us a frame in.
        self.jobs: set[str] = set() if job is None else {job}
        # Jobs whose broadcasts we subscribe to: those we are in, never a wildcard.
        self.broadcasts: set[str] = set() if job is None else {job}
        self.joined_at: dict[str, dict[str, int]] = {}  # job -> counters when we joined it
        # Set once the broker confirmed (SUBACK) our subscription to the job's broadcasts.
        self.heard: dict[str, threading.Event] = {}
        self._subs: dict[int, str] = {}  # a broadcast SUBSCRIBE's message id -> its job
        self._subs_lock = threading.Lock()

    # -- subscriptions ------------------------------------------------------------------

    def subscribe(self, client: mqtt.Client) -> None:
        """Everything we hear, subscribed on every (re)connect."""
        self.statuses.flush(client)
        subs = [topics.my_inboxes(self.me), *self.statuses.topics(), topics.probe(self.me)]
        if self._listen_hellos:
            subs += [f"{topics.ROOT}/agents/+/hello", f"{topics.ROOT}/jobs/+/metrics/+"]
        if self._beat is not None:
            subs.append(f"{topics.ROOT}/agents/+/beat")
        client.subscribe([(t, 1) for t in subs])
        for job in list(self.broadcasts):
            self._subscribe_broadcasts(client, job)

    def _subscribe_broadcasts(self, client: mqtt.Client, job: str) -> None:
        """Subscribe to `job`'s broadcasts; MQTT 5 asks the broker not to echo our own
        (3.1.1 cannot: `route` drops the echo, which still crossed our downlink)."""
        topic = topics.job_broadcasts(job)
        with self._subs_lock:
            self.heard.setdefault(job, threading.Event()).clear()  # until this one's SUBACK
            if self.conn.v5:
                _, mid = client.subscribe(topic, options=SubscribeOptions(qos=1, noLocal=True))
            else:
                _, mid = client.subscribe(topic, qos=1)
            if mid is not None:
                self._subs[mid] = job

    def subscribed(self, mid: int, granted: bool) -> None:
        """A SUBACK (paho's thread): the broker holds the subscription of message `mid`,
        so its job's broadcasts published from now on reach us (`MqttLink.hears`)."""
        with self._subs_lock:
            job = self._subs.pop(mid, None)
            heard = self.heard.get(job) if job is not None else None
        if heard is None:
            return  # not a broadcast subscription, or a job left since
        if not granted:  # e.g. an ACL that lets us write broadcasts but not read them
            self.counters.add("broadcast_subscribe_refused")
            log.error("%s: the broker refused our subscription to job %s's broadcasts",
                      self.me, job)  # fmt: skip
        heard.set()  # refused or not: waiting longer would not help

    def join(self, job: str) -> None:
        """Hold `job`'s frames from now on and subscribe to its broadcasts (see
        `MqttLink.join`)."""
        job = topics.check_id("job", job)
        self.joined_at.setdefault(job, self.counters.snapshot())
        self.jobs.add(job)
        self.hear_broadcasts(job)

    def hear_broadcasts(self, job: str) -> None:
        if job not in self.broadcasts:
            with self._subs_lock:
                self.heard.setdefault(job, threading.Event())  # set by the SUBACK
            self.broadcasts.add(job)
            client = self.conn.client
            if client is not None and self.conn.connected.is_set():
                self._subscribe_broadcasts(client, job)  # else on (re)connect

    def leave(self, job: str) -> None:
        """Forget a finished job: its frames, broadcasts included, are dropped from now on
        (counted as ``inbox_other_job``), and the broker stops sending its broadcasts."""
        self.jobs.discard(job)
        self.joined_at.pop(job, None)
        if topics.is_star(job):
            self.inboxes.close_private(job)
        if job in self.broadcasts:
            self.broadcasts.discard(job)
            with self._subs_lock:
                self.heard.pop(job, None)
            if self.conn.client is not None:
                self.conn.client.unsubscribe(topics.job_broadcasts(job))

    # -- paho's thread ------------------------------------------------------------------

    def route(self, topic: str, payload: bytes, retained: bool = False) -> None:
        cast = topics.parse_broadcast(topic)
        if cast is not None:
            self._route_broadcast(topic, *cast, payload)
            return
        box = topics.parse_inbox(topic)
        if box is not None:
            self._route_inbox(topic, box[0], box[2], payload)
            return
        agent = topics.parse_agent_topic(topic)
        if agent is not None:
            who, leaf = agent
            if leaf == "status":
                if self.statuses.hears(who):
                    self._status(who, payload, retained)
                else:  # dropped from our watch while in flight, or queued for an old session
                    self.counters.add("status_unwatched")
            elif leaf == "hello" and payload:
                self.inboxes.offer(self.inboxes.control, Control("hello", who, payload), topic)
            elif leaf == "probe" and who == self.me:
                self._probe(payload)
            elif leaf == "beat" and self._beat is not None:
                self._beat(who, payload)
            return
        parts = topic.split("/")
        if len(parts) == 6 and parts[4] == "metrics":
            control = Control("metrics", parts[5], payload, parts[3])
            self.inboxes.offer(self.inboxes.control, control, topic)

    def _route_inbox(self, topic: str, job: str, src: str, payload: bytes) -> None:
        self.stats.frames_received += 1
        self.stats.bytes_received += len(payload)
        inboxes = self.inboxes
        private = inboxes.private.get(job)
        if private is None and src == topics.COORDINATOR and topics.is_star(job):
            # A star's exchange, before this agent has opened its endpoint (it still
            # loads its shard while faster members' round 0 is already answered): held
            # for that endpoint, never handed to the control loop as a control frame.
            private = inboxes.open_private(job)
        if private is not None:
            inboxes.offer(private, (job, Delivery(src, payload)), topic)
        elif src in self._control_from or "*" in self._control_from:
            if src == topics.COORDINATOR and job not in self.jobs:
                self.join(job)  # it puts us in the job: peers' frames follow
            inboxes.offer(inboxes.control, Control("frame", src, payload, job), topic)
        elif job not in self.jobs:
            inboxes.dropped("inbox_other_job", topic, len(payload))
        else:
            inboxes.offer(inboxes.data, (job, Delivery(src, payload)), topic)

    def _route_broadcast(self, topic: str, job: str, src: str, payload: bytes) -> None:
        """A member's broadcast goes where its job's inbox frames go; our own echo nowhere."""
        if src == self.me:
            self.counters.add("broadcast_echo")
            return
        self.stats.frames_received += 1
        self.stats.bytes_received += len(payload)
        private = self.inboxes.private.get(job)
        if private is not None:
            self.inboxes.offer(private, (job, Delivery(src, payload)), topic)
        elif job in self.jobs:
            self.inboxes.offer(self.inboxes.data, (job, Delivery(src, payload)), topic)
        else:
            self.inboxes.dropped("inbox_other_job", topic, len(payload))

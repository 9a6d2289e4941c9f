"""MQTT transport on paho-mqtt 2.x: a real broker between agents and the coordinator.

One `MqttLink` is one connection for one identity (an agent id or
``coordinator``). It publishes retained presence on ``agents/{id}/status`` with a
last-will that marks it ``lost`` (both name its job when it was given one:
`peers_in` finds a job's agents, which is how `fedring.connect` rendezvouses),
subscribes to its own inboxes and to everyone's presence, reconnects with
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

Why one module of about 830 lines: paho's callbacks, presence, heartbeats,
reconnection and the bounded send queue share one client and one lock; splitting them would spread
that locking across files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import random
import socket
import ssl
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from fedring.counters import Counters
from fedring.transport import topics
from fedring.transport.base import (
    BROADCAST,
    Deadline,
    Delivery,
    EndpointClosed,
    LinkStats,
    MembershipEvent,
    PeerUnreachable,
    TransportError,
    TransportTimeout,
)
from fedring.wire.jsondoc import parse_document

log = logging.getLogger(__name__)

_MAX_STATUS_BYTES = 1024
# Every link beats BEATS_PER_KEEPALIVE times a keep-alive; a watcher takes a peer that
# has beaten for lost after SILENT_AFTER keep-alives without one. The broker's own check
# (1.5 keep-alives, run only every 5 s by Mosquitto 2.0) would see a hung board late.
BEATS_PER_KEEPALIVE = 3
SILENT_AFTER = 1.25
_WATCH_TICK_S = 0.25
MIN_KEEPALIVE_S = 1.0  # a presence announcing less is taken at this: no instant "lost"


class BrokerUnreachable(TransportError):
    """No connection to the broker before the deadline."""


class BrokerRefused(TransportError):
    """The broker answered but refused us: credentials, ACL or protocol."""


class BrokerTlsError(BrokerRefused):
    """TLS failed: an unreadable CA/certificate/key file, a broker certificate our CA does
    not trust, or a broker that wants a client certificate we did not give."""


class IdentityMismatch(ValueError):
    """A link's id differs from its broker user name: the ACL binds inbox sender levels,
    presence and the client id to the user name, so every publish would be denied."""


def check_identity(me: str, username: str | None) -> None:
    """Refuse an id that is not the user name (anonymous links may use any id)."""
    if username is not None and username != me:
        raise IdentityMismatch(
            f"id {me!r} and broker user name {username!r} differ: the broker binds client "
            "ids and topics to the user name, so run with --id equal to --username"
        )


@dataclass(frozen=True)
class BrokerConfig:
    """Where the broker is and how to talk to it.

    >>> BrokerConfig.parse("mqtt://127.0.0.1:1884").port
    1884
    >>> BrokerConfig.parse("mqtts://broker.lan").port
    8883
    """

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None
    ca: str | None = None  # CA bundle to verify the broker (TLS)
    cert: str | None = None  # client certificate (TLS, optional)
    key: str | None = None  # client key (TLS, optional)
    # Seconds. The broker declares a silent client lost once 1.5x this has passed, but
    # Mosquitto 2.0 runs that check only every 5 s: loss is seen 1.5x + up to 5 s late.
    # Watchers use heartbeats instead (SILENT_AFTER).
    keepalive: int = 5
    # 3.1.1 by default: Mosquitto 2.0.11 restores MQTT 5 sessions after a restart
    # without their queued messages (measured: 862 of 2,075 frames lost; 0 with
    # 3.1.1). "auto" tries 5 and falls back to 3.1.1 when the broker refuses it.
    protocol: Literal["auto", "5", "3.1.1"] = "3.1.1"
    max_queued: int = 4096  # outgoing messages held while the broker is slow or away
    session_expiry_s: int = 600  # MQTT 5: the broker keeps our session this long
    will_delay_s: int = 2  # MQTT 5: "lost" goes out this long after an unclean drop
    # A peer's "lost" counts if our own link stays up this long: a broker going down sends
    # every will, and our own disconnect then voids them.
    lost_grace_s: float = 0.25
    reconnect_max_s: float = 8.0  # reconnect backoff cap (it doubles from 1-2 s)
    # A "lost" read just after our own (re)connect, or a retained one, may be a stale will
    # of a broker restart: the peer gets this long (its backoff cap, plus its connect) to
    # come back before it counts.
    restart_grace_s: float = 12.0
    max_inbox_bytes: int = 128 * 2**20  # payload bytes held in each incoming queue
    max_inbox_items: int = 10_000  # items held in each incoming queue
    connect_timeout_s: float = 15.0
    heartbeat: bool = True  # beat on agents/{id}/beat (QoS 0): watchers see a hung board

    @classmethod
    def parse(cls, url: str, **options: Any) -> BrokerConfig:
        """``mqtt://HOST[:PORT]`` (1883) or ``mqtts://HOST[:PORT]`` (8883, TLS)."""
        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            raise ValueError(
                f"--broker {url!r} must look like mqtt://HOST:PORT or mqtts://HOST:PORT"
            )
        tls = parts.scheme == "mqtts"
        try:
            port = parts.port or (8883 if tls else 1883)
        except ValueError:
            raise ValueError(f"--broker {url!r}: the port must be a number in [1, 65535]") from None
        return cls(parts.hostname, port, tls=tls, **options)

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


@dataclass(frozen=True)
class Control:
    """A message for the daemon's or the coordinator's own loop."""

    kind: Literal["frame", "hello", "metrics", "member"]
    src: str
    data: bytes = b""
    job: str = ""
    event: MembershipEvent | None = None


@dataclass
class _Presence:
    online: dict[str, str] = field(default_factory=dict)  # id -> session
    jobs: dict[str, str] = field(default_factory=dict)  # id -> the job its status names, or ""
    pending_lost: dict[str, str] = field(default_factory=dict)  # id -> session, unconfirmed
    keepalive: dict[str, float] = field(default_factory=dict)  # id -> its announced keep-alive


_Item = TypeVar("_Item", Delivery | MembershipEvent | tuple[str, Delivery], Control)


def _payload_bytes(item: object) -> int:
    if isinstance(item, tuple):
        item = item[1]
    return len(item.data) if isinstance(item, Delivery | Control) else 0


class _Inbox(queue.Queue[_Item], Generic[_Item]):
    """An incoming queue bounded in items and payload bytes.

    paho's network thread fills it and must never block, so `offer` refuses what does
    not fit (the caller counts and logs the drop); `get` and the rest are `queue.Queue`'s.
    """

    def __init__(self, max_items: int, max_bytes: int) -> None:
        super().__init__()
        self.max_items, self.max_bytes = max_items, max_bytes
        self.queued_bytes = 0

    def offer(self, item: _Item) -> bool:
        size = _payload_bytes(item)
        with self.not_full:
            if self._qsize() >= self.max_items or self.queued_bytes + size > self.max_bytes:
                return False
            self._put(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()
        return True

    def _put(self, item: _Item) -> None:
        self.queued_bytes += _payload_bytes(item)
        self.queue.append(item)

    def _get(self) -> _Item:
        item = self.queue.popleft()
        self.queued_bytes -= _payload_bytes(item)
        return item


# A refused connection is retried this long (a broker starting up), then reported.
REFUSED_RETRY_S = 1.0

# A broker that Nagles its writes (Mosquitto without `set_tcp_nodelay true`) holds a
# small message to a client until the client ACKs the one before, and the client's
# delayed ACK makes that ~40 ms a message. Measured on loopback (Mosquitto 2.0.11,
# Linux 6.18, 2 cores shared with load averages of 7-15): two clients ping-ponging
# 100-byte QoS 1 messages took 41-55 ms an exchange without the option (every one of
# 120; the fastest of three: 34-50 ms over 30 checks) and 0.2-0.5 ms with it (spikes
# to 21 ms; the fastest of a check: 0.3-8.3 ms over 30). One connection alone shows
# nothing (its own echoes took 0.1-0.5 ms either way: the broker's answers to one
# client go out together), so two throwaway clients exchange up to NAGLE_EXCHANGES
# messages, and the broker Nagles only if even the fastest took NAGLE_STALL_S: one
# fast exchange ends the check (~5 ms in all; ~140 ms on a Nagle broker).
NAGLE_EXCHANGES = 3
NAGLE_STALL_S = 0.025
NAGLE_CHECK_S = 1.5  # the check's own deadline: connects and exchanges
NAGLE_FIX = ("broker delays small messages (Nagle): add `set_tcp_nodelay true` to "
             "mosquitto.conf; see docs/operations/troubleshooting.md")  # fmt: skip


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
    ) -> None:
        self.cfg = cfg
        self.me = topics.check_id("id", me)
        check_identity(self.me, cfg.username)
        self.job = None if job is None else topics.check_id("job", job)
        self.session = os.urandom(6).hex()
        self.stats = LinkStats()
        self.counters = counters or Counters()
        self.control: _Inbox[Control] = _Inbox(cfg.max_inbox_items, cfg.max_inbox_bytes)
        self._data: _Inbox[Delivery | MembershipEvent | tuple[str, Delivery]] = _Inbox(
            cfg.max_inbox_items, cfg.max_inbox_bytes
        )
        self._private: dict[str, _Inbox[Delivery | MembershipEvent | tuple[str, Delivery]]] = {}
        # Jobs whose peer frames we hold: ours, those with an open endpoint, and those the
        # coordinator (whose sender level only it may write) has sent us a frame in.
        self._jobs: set[str] = set() if job is None else {job}
        # Jobs whose broadcasts we subscribe to: those we are in, never a wildcard, so a
        # flood on another (or a finished) job's topics never reaches our link.
        self._broadcasts: set[str] = set() if job is None else {job}
        self._joined_at: dict[str, dict[str, int]] = {}  # job -> counters when we joined it
        self._reconnected_at = -float("inf")  # monotonic time of our latest reconnect
        self._control_from = frozenset(control_from)
        self._listen_hellos = listen_hellos
        self._presence = _Presence()
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._connack: tuple[bool, str] | None = None
        self._connack_ready = threading.Event()
        self._closed = False
        self._drops = 0  # disconnections so far: a pending "lost" from before one is void
        self._client: mqtt.Client | None = None
        self._v5 = cfg.protocol != "3.1.1"
        self._probe_seen: queue.Queue[bytes] = queue.Queue()
        self._watch = watch
        # peer -> (session, its last beat, its silence limit: SILENT_AFTER x its keep-alive)
        self._beats: dict[str, tuple[str, float, float]] = {}
        self._silent: dict[str, str] = {}  # peer -> session taken for lost by its silence
        self._beater: threading.Thread | None = None
        self._stop_beats = threading.Event()
        self.broker_nagle: bool | None = None  # `check_broker_nagle`'s finding (None: unchecked)

    # -- connection -----------------------------------------------------------

    def connect(self) -> MqttLink:
        """Connect (falling back to MQTT 3.1.1 if asked or needed) and announce presence."""
        try:
            self._connect_once()
        except BrokerRefused as exc:
            if self.cfg.protocol != "auto" or "protocol" not in str(exc).lower():
                raise
            log.info("broker refused MQTT 5 (%s); falling back to 3.1.1", exc)
            self._v5 = False
            self._connect_once()
        return self

    def _connect_once(self) -> None:
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"fedring-{self.me}",
            protocol=mqtt.MQTTv5 if self._v5 else mqtt.MQTTv311,
            clean_session=None if self._v5 else False,
        )
        if self.cfg.username is not None:
            client.username_pw_set(self.cfg.username, self.cfg.password)
        if self.cfg.tls:
            self._tls_set(client)
        # Backoff doubles from ~1 s to 8 s; the jitter keeps a fleet from reconnecting in step.
        backoff = (1 + random.random(), self.cfg.reconnect_max_s)
        client.reconnect_delay_set(*backoff)  # type: ignore[arg-type]
        client.max_queued_messages_set(self.cfg.max_queued)
        client.max_inflight_messages_set(100)
        will_props = None
        if self._v5:  # a broker restart must not look like a death: reconnecting cancels it
            will_props = Properties(PacketTypes.WILLMESSAGE)
            will_props.WillDelayInterval = self.cfg.will_delay_s
        client.will_set(
            topics.status(self.me), self._status("lost"), 1, True, properties=will_props
        )
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_ack
        client.on_log = self._on_log
        client.message_callback_add(topics.status(self.me), self._on_own_status)  # issue 27
        self._client = client
        self._connack_ready.clear()
        props = None
        if self._v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.cfg.session_expiry_s
        where = (self.cfg.host, self.cfg.port)
        # A refused connection is answered at once: retry it briefly (a broker starting
        # up), then say so, rather than wait out connect_timeout_s (issue 27).
        refused_until = Deadline.after(min(REFUSED_RETRY_S, self.cfg.connect_timeout_s))
        pause = 0.1
        while True:
            try:  # TCP (and the TLS handshake) here, where their errors can be named
                client.connect(*where, keepalive=self.cfg.keepalive, properties=props)
            except ssl.SSLError as exc:
                raise BrokerTlsError(f"TLS handshake with broker {self.cfg.url} failed: {exc}"
                                     f"{self._tls_hint(str(exc))}") from None  # fmt: skip
            except ConnectionRefusedError as exc:
                if refused_until.expired:
                    raise BrokerUnreachable(
                        f"broker {self.cfg.url} refused the connection ({exc}): is mosquitto "
                        "running, and is the host and port right?"
                    ) from None
                time.sleep(min(pause * (1 + random.random()), refused_until.remaining()))
                pause *= 2
                continue
            except OSError:  # no route or no answer yet: paho retries until our deadline
                client.connect_async(*where, keepalive=self.cfg.keepalive, properties=props)
            except ValueError as exc:
                raise BrokerUnreachable(f"broker {self.cfg.url}: {exc}") from exc
            break
        client.loop_start()
        if not self._connack_ready.wait(self.cfg.connect_timeout_s):
            self._stop_client()
            raise BrokerUnreachable(
                f"no answer from broker {self.cfg.url} within {self.cfg.connect_timeout_s:g} s "
                "(is mosquitto running, and is the host and port right?)"
            )
        ok, reason = self._connack or (False, "no CONNACK")
        if not ok:
            self._stop_client()
            if reason.startswith("TLS"):
                raise BrokerTlsError(f"broker {self.cfg.url}: {reason}{self._tls_hint(reason)}")
            who = f" as user {self.cfg.username!r}" if self.cfg.username else " anonymously"
            raise BrokerRefused(f"broker {self.cfg.url} refused {self.me!r}{who}: {reason}")

    # -- one process per id (issue 27) --------------------------------------------

    taken_over = ""  # why this link stepped back for another holder of its id ("": never)
    _resumed = False  # the latest subscription was made on a reconnect

    def _on_own_status(self, client: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        """Our presence as the broker retained it when we (re)subscribed: "online" under
        another session means another process connected with our id and holds it (the
        broker handed it our session). Step back: two holders would take the session
        from each other at every reconnect, for as long as both live. Its presence is
        put back as it was and we leave without a will; the owner reads `taken_over`."""
        try:
            if not msg.retain or self._closed or (self._v5 and not self._resumed):
                return
            try:
                doc = parse_document(msg.payload, max_bytes=_MAX_STATUS_BYTES, what="status")
            except ValueError:  # a FrameError: not a presence a link of ours wrote
                return
            if doc.get("state") != "online":
                return
            session = str(doc.get("session", ""))
            if session in ("", self.session):
                return
            self.taken_over = (
                f"another process holds the id {self.me!r} at {self.cfg.url} (session "
                f"{session}); this one ({self.session}) stepped back (if no other process "
                f"holds it, clear its presence: mosquitto_pub -r -n -t {msg.topic})"
            )
            log.error("%s", self.taken_over)
            self.counters.add("id_taken_over")
            self._closed = True
            self._stop_beats.set()
            client.publish(msg.topic, msg.payload, qos=1, retain=True)
            client.disconnect()
        except Exception:  # a callback that raises would stop paho's network loop
            self.counters.add("mqtt_callback_error")
            log.exception("%s: error reading its own presence", self.me)

    def _tls_set(self, client: mqtt.Client) -> None:
        for option, path in (("--ca", self.cfg.ca), ("--cert", self.cfg.cert),
                             ("--key", self.cfg.key)):  # fmt: skip
            if path is not None and not os.path.isfile(path):
                raise BrokerTlsError(f"{option} {path!r}: no such file")
        try:
            client.tls_set(ca_certs=self.cfg.ca, certfile=self.cfg.cert, keyfile=self.cfg.key)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError: a bad PEM file
            files = f"--ca {self.cfg.ca!r}, --cert {self.cfg.cert!r}, --key {self.cfg.key!r}"
            raise BrokerTlsError(f"cannot load TLS files ({files}): {exc}") from None

    def _tls_hint(self, error: str) -> str:
        if "CERTIFICATE_VERIFY_FAILED" in error:
            return (f" (is the broker's certificate signed by --ca {self.cfg.ca!r}, and does it "
                    f"name {self.cfg.host!r}?)")  # fmt: skip
        rejected = ("CERTIFICATE_REQUIRED", "EOF occurred", "UNKNOWN_CA", "BAD_CERTIFICATE")
        if self.cfg.cert is not None and any(code in error for code in rejected):
            # We did send one (an untrusted one reads as EOF, the alert lost in the close)
            return (f" (the broker does not trust the client certificate --cert "
                    f"{self.cfg.cert!r}: is it signed by a CA in the broker's cafile, "
                    "and still valid?)")  # fmt: skip
        if "CERTIFICATE_REQUIRED" in error:
            return " (the broker wants a client certificate: give --cert and --key)"
        if "EOF occurred" in error:  # the broker's alert lost in the race with its close
            return (" (the broker closed the TLS session unanswered: does it want a client "
                    "certificate? give --cert and --key, signed by a CA it trusts)")  # fmt: skip
        if "UNKNOWN_CA" in error or "BAD_CERTIFICATE" in error:
            return f" (the broker does not trust the client certificate --cert {self.cfg.cert!r})"
        return ""

    def _on_log(self, _c: mqtt.Client, _u: Any, level: int, text: str) -> None:
        """Before the first CONNACK, a TLS error on the socket is the broker's answer: a
        missing client certificate shows only here, when the broker's alert is read."""
        tls = "SSL" in text or "_ssl.c" in text
        if level == mqtt.MQTT_LOG_ERR and tls and not self._connack_ready.is_set():
            self._connack = (False, f"TLS: {text}")
            self._connack_ready.set()

    def _status(self, state: str) -> bytes:
        doc: dict[str, Any] = {"state": state, "session": self.session, "ts": time.time(),
                               "keepalive": self.cfg.keepalive}  # watchers' silence limit
        if self.job is not None:
            doc["job"] = self.job
        return json.dumps(doc).encode()

    def _on_connect(self, client: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        if rc.is_failure:
            self._connack = (False, str(rc))
            self._connack_ready.set()
            return
        sock = client.socket()
        if isinstance(sock, socket.socket):  # small QoS 1 frames: Nagle would add ~40 ms each
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Under MQTT 5 a restarted process's first connect resumes its predecessor's session,
        # which cancels the predecessor's delayed will: the retained "online" it finds may
        # be a dead process's, so only a reconnect's may make it step back (`_on_own_status`).
        self._resumed = self._connack is not None and self._connack[0]
        subs = [topics.my_inboxes(self.me), f"{topics.ROOT}/agents/+/status", topics.probe(self.me)]
        if self._listen_hellos:
            subs += [f"{topics.ROOT}/agents/+/hello", f"{topics.ROOT}/jobs/+/metrics/+"]
        if self._watch:
            subs.append(f"{topics.ROOT}/agents/+/beat")
            now = time.monotonic()  # beats sent while we were away never reached us
            with self._lock:
                self._beats = {who: (s, now, lim) for who, (s, _t, lim) in self._beats.items()}
        client.subscribe([(t, 1) for t in subs])
        for job in list(self._broadcasts):
            self._subscribe_broadcasts(client, job)
        client.publish(topics.status(self.me), self._status("online"), qos=1, retain=True)
        if self._connack is not None and self._connack[0]:
            self.counters.add("mqtt_reconnect")
            self._reconnected_at = time.monotonic()
            log.info("%s reconnected to %s", self.me, self.cfg.url)
        self._connack = (True, "")
        self._connected.set()
        self._connack_ready.set()
        if self.cfg.heartbeat and self._beater is None:
            self._beater = threading.Thread(target=self._beat_loop, daemon=True,
                                            name=f"beat-{self.me}")  # fmt: skip
            self._beater.start()

    def _subscribe_broadcasts(self, client: mqtt.Client, job: str) -> None:
        """Subscribe to `job`'s broadcasts; MQTT 5 asks the broker not to echo our own
        (3.1.1 cannot: `_route` drops the echo, which still crossed our downlink)."""
        if self._v5:
            client.subscribe(topics.job_broadcasts(job), options=SubscribeOptions(qos=1,
                             noLocal=True))  # fmt: skip
        else:
            client.subscribe(topics.job_broadcasts(job), qos=1)

    def _on_disconnect(self, _c: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        self._connected.clear()
        with self._lock:
            self._drops += 1
        if not self._closed and self._connack is not None and self._connack[0]:
            self.counters.add("mqtt_disconnect")
            log.warning("%s lost the broker %s (%s); reconnecting", self.me, self.cfg.url, rc)

    def _stop_client(self) -> None:
        if self._client is not None:
            self._client.loop_stop()
            self._client.disconnect()

    # -- incoming -------------------------------------------------------------

    def _on_ack(self, client: mqtt.Client, *_: Any) -> None:
        _quick_ack(client)

    def _on_message(self, client: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        _quick_ack(client)
        try:
            self._route(msg.topic, bytes(msg.payload), bool(msg.retain))
        except Exception:  # a callback that raises would stop paho's network loop
            self.counters.add("mqtt_callback_error")
            log.exception("%s: error handling a message on %s", self.me, msg.topic)

    def _route(self, topic: str, payload: bytes, retained: bool = False) -> None:
        cast = topics.parse_broadcast(topic)
        if cast is not None:
            self._route_broadcast(topic, *cast, payload)
            return
        box = topics.parse_inbox(topic)
        if box is not None:
            job, _dst, src = box
            self.stats.frames_received += 1
            self.stats.bytes_received += len(payload)
            private = self._private.get(job)
            if private is not None:
                self._offer(private, (job, Delivery(src, payload)), topic)
            elif src in self._control_from or "*" in self._control_from:
                if src == topics.COORDINATOR and job not in self._jobs:
                    self.join(job)  # it puts us in the job: peers' frames follow
                self._offer(self.control, Control("frame", src, payload, job), topic)
            elif job not in self._jobs:
                self._dropped("inbox_other_job", topic, len(payload))
            else:
                self._offer(self._data, (job, Delivery(src, payload)), topic)
            return
        agent = topics.parse_agent_topic(topic)
        if agent is not None:
            who, leaf = agent
            if leaf == "status":
                self._presence_changed(who, payload, retained)
            elif leaf == "hello" and payload:
                self._offer(self.control, Control("hello", who, payload), topic)
            elif leaf == "probe" and who == self.me:
                self._probe_seen.put(payload)
            elif leaf == "beat" and self._watch:
                self._on_beat(who, payload)
            return
        parts = topic.split("/")
        if len(parts) == 6 and parts[4] == "metrics":
            self._offer(self.control, Control("metrics", parts[5], payload, parts[3]), topic)

    def _route_broadcast(self, topic: str, job: str, src: str, payload: bytes) -> None:
        """A member's broadcast goes where its job's inbox frames go; our own echo nowhere."""
        if src == self.me:
            self.counters.add("broadcast_echo")
            return
        self.stats.frames_received += 1
        self.stats.bytes_received += len(payload)
        private = self._private.get(job)
        if private is not None:
            self._offer(private, (job, Delivery(src, payload)), topic)
        elif job in self._jobs:
            self._offer(self._data, (job, Delivery(src, payload)), topic)
        else:
            self._dropped("inbox_other_job", topic, len(payload))

    def _offer(self, inbox: _Inbox[_Item], item: _Item, what: str) -> None:
        if not inbox.offer(item):
            self._dropped("inbox_full", what, _payload_bytes(item))

    def _dropped(self, reason: str, what: str, size: int) -> None:
        """Count a message we will not hold; log the first and every 1,000th of each reason."""
        self.counters.add(reason)
        count = self.counters.get(reason)
        if count == 1 or count % 1000 == 0:
            why = "not in its job" if reason == "inbox_other_job" else "incoming queue full"
            log.warning("%s dropped %d bytes on %s (%s; %d dropped so far)",
                        self.me, size, what, why, count)  # fmt: skip

    def _presence_changed(self, who: str, payload: bytes, retained: bool) -> None:
        if who == self.me:
            return
        state, session, job, keepalive = "offline", "", "", float(self.cfg.keepalive)
        if payload:  # an oversized one is refused (counted) by the parser
            try:
                doc = parse_document(payload, max_bytes=_MAX_STATUS_BYTES, what="status")
                state, session = str(doc.get("state", "offline")), str(doc.get("session", ""))
                job = str(doc.get("job", ""))
                keepalive = _announced_keepalive(doc.get("keepalive"), keepalive)
            except (ValueError, AttributeError):
                self.counters.add("bad_status")
                log.warning("%s: unreadable status from %s", self.me, who)
                return
        events: list[MembershipEvent] = []
        with self._lock:
            known = self._presence.online.get(who)
            self._presence.pending_lost.pop(who, None)
            self._silent.pop(who, None)
            if state == "online":
                if known != session:
                    if known is not None:  # restarted without us seeing it go
                        events.append(MembershipEvent("lost", who))
                    events.append(MembershipEvent("joined", who))
                    self._presence.online[who] = session
                    self._presence.jobs[who] = job
                    self._presence.keepalive[who] = keepalive
            elif known is not None and (not session or session == known):
                if state == "lost":  # confirmed later: a broker going down sends every will
                    self._presence.pending_lost[who] = session
                    grace = self._lost_grace(retained)
                    timer = threading.Timer(grace, self._confirm_lost, (who, session, self._drops))
                    timer.daemon = True
                    timer.start()
                else:
                    del self._presence.online[who]
                    events.append(MembershipEvent("left", who))
        self._emit(who, events)

    def _lost_grace(self, retained: bool) -> float:
        """A will read right after our own (re)connect, or a retained one, may be left over
        from a broker restart (sent on its way down, or queued in our session while it was
        away): wait for the peer's reconnect. Any other is fresh: the broker saw it die."""
        settling = time.monotonic() - self._reconnected_at < self.cfg.restart_grace_s
        return self.cfg.restart_grace_s if retained or settling else self.cfg.lost_grace_s

    def _confirm_lost(self, who: str, session: str, drops: int) -> None:
        with self._lock:
            if self._presence.pending_lost.get(who) != session:
                return  # it came back, or a newer status replaced this one
            if drops != self._drops or not self._connected.is_set():
                return  # we lost the broker meanwhile: the status will be re-read
            del self._presence.pending_lost[who]
            self._presence.online.pop(who, None)
        self._emit(who, [MembershipEvent("lost", who)])

    # -- heartbeats -----------------------------------------------------------

    def _beat_loop(self) -> None:
        """Beat every keepalive / BEATS_PER_KEEPALIVE s; a watcher also checks silences."""
        period = self.cfg.keepalive / BEATS_PER_KEEPALIVE
        due = 0.0
        while not self._stop_beats.wait(_WATCH_TICK_S if self._watch else period):
            now = time.monotonic()
            client = self._client
            if now >= due and client is not None and self._connected.is_set():
                beat = f"{self.session} {self.cfg.keepalive}".encode()
                client.publish(topics.beat(self.me), beat, qos=0)
                due = now + period
            if self._watch:
                self._check_silences(now)

    def _on_beat(self, who: str, payload: bytes) -> None:
        """A beat is ``SESSION [KEEPALIVE]``; it counts only for the session the peer's
        presence announced, and its silence limit is SILENT_AFTER x the keep-alive that
        presence announced (never one a beat carries: one forged beat with a tiny
        keep-alive would have a live peer taken for lost at once).
        A watcher hears its own beats too (it subscribes to every agent's): ignored."""
        if who == self.me:
            return
        session = payload[:64].decode("ascii", "replace").partition(" ")[0]
        events: list[MembershipEvent] = []
        with self._lock:
            known = self._presence.online.get(who) or self._silent.get(who)
            if not session or session != known:
                self.counters.add("bad_beat")
                return
            keepalive = self._presence.keepalive.get(who, float(self.cfg.keepalive))
            limit = SILENT_AFTER * keepalive
            self._beats[who] = (session, time.monotonic(), limit)
            if self._silent.get(who) == session and who not in self._presence.online:
                del self._silent[who]  # it was hung, not dead: it is back as it was
                self._presence.online[who] = session
                events.append(MembershipEvent("joined", who))
        self._emit(who, events)

    def _check_silences(self, now: float) -> None:
        """A peer that has beaten and then stayed silent for SILENT_AFTER keep-alives is
        lost (while we ourselves are connected: our own outage silences everyone)."""
        if not self._connected.is_set():
            return
        silent: list[tuple[str, float]] = []
        with self._lock:
            for who, (session, last, limit) in self._beats.items():
                if now - last > limit and self._presence.online.get(who) == session:
                    del self._presence.online[who]
                    self._silent[who] = session
                    silent.append((who, now - last))
        for who, quiet in silent:
            self.counters.add("peer_silent")
            log.warning("%s: no heartbeat from %s for %.1f s; taking it for lost",
                        self.me, who, quiet)  # fmt: skip
            self._emit(who, [MembershipEvent("lost", who)])

    def _emit(self, who: str, events: list[MembershipEvent]) -> None:
        for event in events:
            log.info("%s sees %s %s", self.me, who, event.kind)
            for inbox in (self._data, *self._private.values()):
                self._offer(inbox, event, f"{who} {event.kind}")
            self._offer(self.control, Control("member", who, event=event), f"{who} {event.kind}")

    # -- outgoing -------------------------------------------------------------

    def publish(self, topic: str, data: bytes, deadline: Deadline, *, retain: bool = False) -> None:
        """QoS 1 publish; waits for room in the outgoing queue until `deadline`."""
        if self._closed or self._client is None:
            raise EndpointClosed(f"link {self.me!r} is closed")
        while True:
            info = self._client.publish(topic, data, qos=1, retain=retain)
            if info.rc == mqtt.MQTT_ERR_SUCCESS or info.rc == mqtt.MQTT_ERR_NO_CONN:
                break  # NO_CONN: queued, sent once we reconnect
            if info.rc != mqtt.MQTT_ERR_QUEUE_SIZE:
                raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
            if deadline.expired:
                self.counters.add("send_queue_full")
                raise TransportTimeout(f"outgoing queue of {self.me!r} stayed full")
            time.sleep(0.005)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(data)

    def send_to(self, job: str, dst: str, data: bytes, deadline: Deadline) -> None:
        self.publish(topics.inbox(job, dst, self.me), data, deadline)
        self.stats.per_peer_sent[dst] = self.stats.per_peer_sent.get(dst, 0) + len(data)

    def broadcast_to(self, job: str, data: bytes, deadline: Deadline) -> None:
        """One publish on `job`'s broadcast topic: the broker hands it to every member."""
        self.publish(topics.broadcast(job, self.me), data, deadline)
        self.stats.per_peer_sent[BROADCAST] = self.stats.per_peer_sent.get(BROADCAST, 0) + len(data)

    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._presence.online)

    def peers_in(self, job: str) -> dict[str, str]:
        """Online peers whose presence names `job` (links made with ``job=``): id -> session."""
        with self._lock:
            jobs = self._presence.jobs
            return {who: s for who, s in self._presence.online.items() if jobs.get(who) == job}

    def wait_connected(self, deadline: Deadline) -> bool:
        return self._connected.wait(deadline.remaining())

    def probe_bandwidth(self, total: int = 256 * 1024, piece: int = 64 * 1024) -> float:
        """Bytes per second of a round trip through the broker (0.0 if it fails)."""
        return self.probe_link(total, piece).get("link_bps", 0.0)

    def probe_link(self, total: int = 256 * 1024, piece: int = 64 * 1024) -> dict[str, float]:
        """This link to the broker, measured on the link's own probe topic (0.0: failed).

        ``rtt_s``: the best of three tiny messages there and back. ``up_bps``: `total`
        bytes published (QoS 1) until the broker acknowledged the last, less one round
        trip. ``link_bps``: the same bytes there and back. ``down_bps``: from the time
        the pieces took to come back (`_down_bps`). ``broker_nagle``: 1.0 if the broker
        delays small messages (`check_broker_nagle`; 0.0 if not, or not checked; absent
        from a closed link's).
        """
        out = {"rtt_s": 0.0, "up_bps": 0.0, "down_bps": 0.0, "link_bps": 0.0}
        if self._closed or self._client is None:
            return out
        nagle = self.check_broker_nagle() if self.broker_nagle is None else self.broker_nagle
        out["broker_nagle"] = 1.0 if nagle else 0.0
        while not self._probe_seen.empty():
            self._probe_seen.get_nowait()
        deadline = Deadline.after(10.0)
        try:
            rtts = []
            for _ in range(3):
                start = time.perf_counter()
                self.publish(topics.probe(self.me), b"rtt", deadline)
                self._probe_seen.get(timeout=deadline.remaining() or 1e-3)
                rtts.append(time.perf_counter() - start)
            rtt = min(rtts)
            pieces = max(1, total // piece)
            start = time.perf_counter()
            infos = [self._client.publish(topics.probe(self.me), bytes(piece), qos=1)
                     for _ in range(pieces)]  # fmt: skip
            for info in infos:
                info.wait_for_publish(timeout=deadline.remaining() or 1e-3)
            up = time.perf_counter() - start
            for _ in range(pieces):
                self._probe_seen.get(timeout=deadline.remaining() or 1e-3)
            both = time.perf_counter() - start
        except (queue.Empty, TransportError, RuntimeError, ValueError):
            return out
        self.stats.frames_sent += 3 + pieces
        self.stats.bytes_sent += 9 + pieces * piece
        size = pieces * piece
        up_bps = size / max(up - rtt, 1e-6)
        return {**out, "rtt_s": rtt, "up_bps": up_bps, "down_bps": _down_bps(size, piece,
                up_bps, both - rtt), "link_bps": size / max(both, 1e-9)}  # fmt: skip

    def check_broker_nagle(self) -> bool | None:
        """Whether the broker Nagles small messages (`NAGLE_STALL_S`): if so, warn once
        naming the fix and count ``broker_nagle``. None: not checked.

        Two throwaway clients (ids ``fedring-{me}-nagle-*``, clean sessions) ping-pong
        on sub-topics of our probe topic; it takes well under 0.1 s on a good broker and
        at most `NAGLE_CHECK_S`. Skipped with a user name: a broker that makes each
        client id its user name (examples/mosquitto.conf) would hand them our session.
        Our own link acks at once (`_quick_ack`), which hides most of the delay on
        Linux, but the broker still Nagles every other client it serves.
        """
        if self.cfg.username is not None or self._closed:
            return None
        fastest = _nagle_exchange(self.cfg, self.me)
        if fastest is None:
            return None
        self.broker_nagle = fastest >= NAGLE_STALL_S
        if self.broker_nagle:
            self.counters.add("broker_nagle")
            log.warning("%s: %s (a small message there and back took %.0f ms at best)",
                        self.me, NAGLE_FIX, fastest * 1e3)  # fmt: skip
        return self.broker_nagle

    def interrupt(self, channel_job: str) -> None:
        """Wake a `PeerChannel` of `channel_job` blocked in `recv`: it raises
        `CollectiveInterrupted` (channels of other jobs ignore it)."""
        for inbox in (self._data, *self._private.values()):
            inbox.put(MembershipEvent("interrupted", channel_job))

    def endpoint(self, job: str, *, private: bool = False) -> MqttEndpoint:
        """The job's `Endpoint`; from now on peers' frames of `job` are held for it.

        A `private` one has its own queue and takes the frames of every sender in
        `job`, those of `control_from` included, until it is closed.
        """
        endpoint = MqttEndpoint(self, job)
        if private:
            endpoint.inbox = _Inbox(self.cfg.max_inbox_items, self.cfg.max_inbox_bytes)
            # copied on write: paho's thread reads it without the lock
            self._private = {**self._private, endpoint.job: endpoint.inbox}
            self._hear_broadcasts(endpoint.job)
        elif endpoint.job not in self._jobs:
            self.join(endpoint.job)
        return endpoint

    def join(self, job: str) -> None:
        """Hold `job`'s frames from now on and subscribe to its broadcasts.

        An agent joins when the coordinator's first frame in the job reaches it (on
        paho's thread, before the manifest is even read), so its subscription is in
        place long before a faster member, which must still load and verify its shard,
        broadcasts round 0. The counters at this moment are the job's baseline
        (`counters_since`): what is dropped while the job is set up is the job's."""
        job = topics.check_id("job", job)
        self._joined_at.setdefault(job, self.counters.snapshot())
        self._jobs.add(job)
        self._hear_broadcasts(job)

    def leave(self, job: str) -> None:
        """Forget a finished job: its frames, broadcasts included, are dropped from now on
        (counted as ``inbox_other_job``), and the broker stops sending its broadcasts."""
        self._jobs.discard(job)
        self._joined_at.pop(job, None)
        if job in self._broadcasts:
            self._broadcasts.discard(job)
            if self._client is not None:
                self._client.unsubscribe(topics.job_broadcasts(job))

    def counters_since(self, job: str) -> dict[str, int]:
        """The counters when this link joined `job` (empty if it never did)."""
        return dict(self._joined_at.get(job, {}))

    def _hear_broadcasts(self, job: str) -> None:
        if job not in self._broadcasts:
            self._broadcasts.add(job)
            if self._client is not None and self._connected.is_set():
                self._subscribe_broadcasts(self._client, job)  # else on (re)connect

    @property
    def queued_bytes(self) -> int:
        """Payload bytes waiting in the incoming queues (bounded by `max_inbox_bytes` each)."""
        private = sum(inbox.queued_bytes for inbox in self._private.values())
        return self._data.queued_bytes + self.control.queued_bytes + private

    def close(self, state: str = "offline") -> None:
        """Say goodbye (retained status), then disconnect."""
        if self._closed or self._client is None:
            return
        try:
            info = self._client.publish(topics.status(self.me), self._status(state), 1, True)
            info.wait_for_publish(2.0)
        except (RuntimeError, ValueError):
            pass
        self._closed = True
        self._stop_beats.set()
        props = None
        if self._v5:  # the broker forgets our session with this goodbye
            props = Properties(PacketTypes.DISCONNECT)
            props.SessionExpiryInterval = 0
        self._client.disconnect(properties=props)
        self._client.loop_stop()
        # Also under MQTT 5: the broker may read a newcomer's CONNECT before our
        # DISCONNECT (seen under load); a clean connect that it answers leaves no doubt.
        self._forget_session(self._status(state))

    def _forget_session(self, goodbye: bytes) -> None:
        """The broker keeps a persistent session (and queues what its subscriptions match)
        until a clean-session connect with our id: make one, so that a clean goodbye
        leaves nothing behind (a crashed link's session is left to the broker's
        ``persistent_client_expiration``).

        If the broker reads this connect before our DISCONNECT, it takes the old
        connection over and sends its will ("lost"): the clean session says `goodbye`
        again, after the takeover, so the retained status is the goodbye."""
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"fedring-{self.me}",
                             protocol=mqtt.MQTTv311, clean_session=True)  # fmt: skip
        if self.cfg.username is not None:
            client.username_pw_set(self.cfg.username, self.cfg.password)
        answered = threading.Event()
        client.on_connect = lambda *_args: answered.set()
        try:
            if self.cfg.tls:
                self._tls_set(client)
            client.connect(self.cfg.host, self.cfg.port, keepalive=self.cfg.keepalive)
            client.loop_start()
            if answered.wait(2.0):
                info = client.publish(topics.status(self.me), goodbye, qos=1, retain=True)
                info.wait_for_publish(2.0)
                client.disconnect()
            client.loop_stop()
        except (OSError, RuntimeError, TransportError, ValueError) as exc:  # gone: the expiry's job
            log.info("%s: could not clear its broker session (%s)", self.me, exc)

    def kill(self) -> None:
        """Drop the connection without a goodbye (tests): the broker sends our will."""
        self._closed = True
        self._stop_beats.set()
        if self._client is not None:
            self._client.loop_stop()
            sock = self._client.socket()
            if sock is not None:
                sock.close()


class MqttEndpoint:
    """The `Endpoint` of one job over a link: what `PeerChannel` sends and receives on."""

    def __init__(self, link: MqttLink, job: str) -> None:
        self.link = link
        self.job = topics.check_id("job", job)
        self.name = link.me
        self.stats = LinkStats()  # this job's ring frames only; `link.stats` counts everything
        self.inbox = link._data  # a private endpoint's own queue (`MqttLink.endpoint`)

    def send(self, dst: str, data: bytes, deadline: Deadline) -> None:
        soon = Deadline.after(min(2.0, deadline.remaining()))
        while dst not in self.link.peers() and not soon.expired:
            time.sleep(0.02)  # its retained status may not have reached us yet
        if dst not in self.link.peers():
            raise PeerUnreachable(f"{dst!r} is not online at broker {self.link.cfg.url}")
        self.link.send_to(self.job, dst, data, deadline)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(data)
        self.stats.per_peer_sent[dst] = self.stats.per_peer_sent.get(dst, 0) + len(data)

    def broadcast(self, data: bytes, deadline: Deadline) -> None:
        """One publish that every member of the job receives (see `Broadcaster`)."""
        self.link.broadcast_to(self.job, data, deadline)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(data)
        self.stats.per_peer_sent[BROADCAST] = self.stats.per_peer_sent.get(BROADCAST, 0) + len(data)

    def recv(self, deadline: Deadline) -> Delivery | MembershipEvent:
        while True:
            try:
                item = self.inbox.get(timeout=max(deadline.remaining(), 1e-4))
            except queue.Empty:
                raise TransportTimeout(
                    f"{self.name!r} received nothing before the deadline"
                ) from None
            if isinstance(item, tuple):
                job, delivery = item
                if job != self.job:
                    self.link.counters.add("frame_other_job")
                    continue
                self.stats.frames_received += 1
                self.stats.bytes_received += len(delivery.data)
                return delivery
            return item

    def peers(self) -> frozenset[str]:
        return self.link.peers()

    def close(self) -> None:
        """The link outlives the job; closing a job's endpoint leaves it connected
        (a private endpoint's frames are dropped from now on)."""
        link = self.link
        if self.inbox is not link._data:
            link._private = {j: q for j, q in link._private.items() if j != self.job}


def _announced_keepalive(value: object, default: float) -> float:
    """The keep-alive a peer's presence announces, within what a broker accepts
    (1 s to 18 h; MQTT's own field is 16 bits); `default` if it announced none."""
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        return default
    return min(max(float(value), MIN_KEEPALIVE_S), 65535.0)  # type: ignore[arg-type]


def _down_bps(size: int, piece: int, up_bps: float, seconds: float) -> float:
    """The down link's bytes per second from a pipelined echo of `size` bytes in
    `piece`s that took `seconds` (less one round trip) to come back in full.

    The broker forwards each piece once it has it, so when the down link is the
    slower the echo takes ``piece/up + size/down``. When it is the faster, the up link
    paces the echo and the down link's own rate cannot be told apart from noise (one
    piece's worth): it is taken to be the up link's, a lower bound.
    """
    slower = seconds - piece / up_bps
    return min(size / slower, up_bps) if slower > 0 else up_bps


def _quick_ack(client: mqtt.Client) -> None:
    """ACK what the broker sent now (Linux's TCP_QUICKACK; it lapses, so it is re-armed
    after every packet we read): a broker that Nagles waits for our ACK before its next
    small write, and a delayed ACK makes that wait ~40 ms (`NAGLE_STALL_S`)."""
    sock = client.socket()
    if isinstance(sock, socket.socket) and hasattr(socket, "TCP_QUICKACK"):
        with contextlib.suppress(OSError):  # closing under us: the next connection re-arms it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


def _nagle_exchange(cfg: BrokerConfig, me: str) -> float | None:
    """Seconds of the fastest of up to NAGLE_EXCHANGES small round trips between two
    throwaway clients through the broker (None: they could not connect or exchange)."""
    tag = os.urandom(4).hex()
    deadline = Deadline.after(NAGLE_CHECK_S)
    got = {side: queue.Queue[float]() for side in "ab"}
    clients: list[mqtt.Client] = []
    try:
        for side in "ab":
            topic = f"{topics.probe(me)}/nagle-{tag}/{side}"
            clients.append(_nagle_client(cfg, f"fedring-{me}-nagle-{tag}-{side}", topic,
                                         got[side], deadline))  # fmt: skip
        a, b = clients
        fastest = math.inf
        for _ in range(NAGLE_EXCHANGES):
            start = time.perf_counter()
            a.publish(f"{topics.probe(me)}/nagle-{tag}/b", bytes(100), qos=1)
            got["b"].get(timeout=max(deadline.remaining(), 1e-3))
            b.publish(f"{topics.probe(me)}/nagle-{tag}/a", bytes(100), qos=1)
            got["a"].get(timeout=max(deadline.remaining(), 1e-3))
            fastest = min(fastest, time.perf_counter() - start)
            if fastest < NAGLE_STALL_S:
                break
        return fastest
    except (queue.Empty, OSError, ValueError, TransportError) as exc:
        log.info("%s: could not check the broker for Nagle (%s)", me, exc or "no echo")
        return None
    finally:
        for client in clients:
            client.disconnect()
            client.loop_stop()


def _nagle_client(cfg: BrokerConfig, cid: str, topic: str, got: queue.Queue[float],
                  deadline: Deadline) -> mqtt.Client:  # fmt: skip
    """A clean-session client subscribed to `topic`, which puts each arrival's time in
    `got`; without TCP_QUICKACK, as most clients run."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv311,
                         clean_session=True)  # fmt: skip
    ready = threading.Event()

    def on_connect(c: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        sock = c.socket()
        if not rc.is_failure and isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c.subscribe(topic, qos=1)

    client.on_connect = on_connect
    client.on_subscribe = lambda *_: ready.set()
    client.on_message = lambda *_: got.put(time.perf_counter())
    if cfg.tls:
        client.tls_set(ca_certs=cfg.ca, certfile=cfg.cert, keyfile=cfg.key)
    client.connect(cfg.host, cfg.port, keepalive=max(cfg.keepalive, 5))
    client.loop_start()
    if not ready.wait(max(deadline.remaining(), 1e-3)):
        client.disconnect()
        client.loop_stop()
        raise TransportError(f"{cid} was not subscribed at {cfg.url} in time")
    return client

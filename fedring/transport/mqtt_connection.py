"""One MQTT link's connection to the broker: connect, reconnect, publish.

`Connection` owns the paho client and everything about the session with the broker:
connecting (MQTT 5 falling back to 3.1.1 when asked, a refused connection retried
briefly, TLS errors named), the retained presence and the will that marks us ``lost``,
the reconnects paho makes with backoff and jitter, and the broker's cap on a packet:
a message over it leaves in parts and arrives joined (`mqtt_parts`). What the link does on top
(subscribing, reading messages, watching peers, stepping back for another holder of our
id: `mqtt_session`) it hears through `Hooks`.

Locking: paho's network thread runs the `on_*` callbacks; the caller's thread runs
`connect` and `publish`. They share only the `connected` and `ready` events,
the ``closed`` flag (set once, never cleared) and ``broker_max`` (an int, written at
each CONNACK); the rest is written before ``loop_start`` or on paho's thread alone
(the `Joiner`), or on the caller's alone (the message ids).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from fedring.counters import Counters
from fedring.logs_limit import LogLimiter
from fedring.transport import topics
from fedring.transport.base import (
    Deadline,
    EndpointClosed,
    LinkStats,
    TransportError,
    TransportTimeout,
)
from fedring.transport.mqtt_broker import (
    BrokerConfig,
    BrokerRefused,
    BrokerTlsError,
    BrokerUnreachable,
    MessageTooLarge,
    open_socket,
    tls_hint,
    tls_set,
)
from fedring.transport.mqtt_parts import Joiner, PartError, is_part, packet_size, split_message

log = logging.getLogger("fedring.transport.mqtt")

# A drop right after a packet larger than this, with no cap known, is likely the broker's
# cap (EMQX's default is 1 MiB, AWS IoT Core's 128 KB; no broker caps below 64 KiB here).
SUSPECT_CAP = 64 * 1024
PACKET_TOO_LARGE = 0x95  # MQTT 5 reason code
UPLINK_PART_KEEPALIVES = 0.5  # a part takes at most this share of a keep-alive to send
MIN_UPLINK_PART = 16 * 1024  # no smaller, however slow the uplink measured


@dataclass(frozen=True)
class Hooks:
    """What the link does when its connection changes; all run on paho's thread."""

    up: Callable[[mqtt.Client, bool], None]  # connected (True: a reconnect): subscribe
    down: Callable[[], None]  # the broker is gone for now; paho reconnects
    received: Callable[[str, bytes, bool], None]  # topic, payload, retained
    own_status: Callable[[mqtt.Client, mqtt.MQTTMessage], None]  # our retained presence
    subscribed: Callable[[int, bool], None] = lambda _mid, _ok: None  # a SUBACK: mid, granted


class Connection:
    """The broker session of identity `me`; ``closed`` once it said goodbye or stepped back."""

    def __init__(self, cfg: BrokerConfig, me: str, job: str | None, counters: Counters,
                 stats: LinkStats) -> None:  # fmt: skip
        self.cfg, self.me, self.job, self.counters, self.stats = cfg, me, job, counters, stats
        self.session = os.urandom(6).hex()
        self.client: mqtt.Client | None = None
        self.connected = threading.Event()
        self.closed = False
        self.v5 = cfg.protocol != "3.1.1"
        self._connack: tuple[bool, str] | None = None
        self._ready = threading.Event()  # the broker answered our CONNECT (or TLS failed)
        self.resumed = False  # the latest subscription was made on a reconnect
        self._hooks: Hooks | None = None
        self.broker_max = 0  # MQTT 5: the Maximum Packet Size of the broker's CONNACK
        self._largest = 0  # bytes of the largest packet published since we last connected
        self._joiner = Joiner(max_bytes=cfg.max_inbox_bytes)
        self._log = LogLimiter(log, f"message parts refused by {me}")
        # a handler's exceptions: a few tracebacks per (kind of topic, error) in the log
        self.errors = LogLimiter(log, f"errors handling messages at {me}")
        self._msg_ids = itertools.count(int.from_bytes(os.urandom(4), "big") << 16)
        # our QoS 1 packets the broker has not acknowledged yet, with their sizes: what a
        # beat published now waits behind on our uplink (`unacked_bytes`)
        self._unacked: list[tuple[mqtt.MQTTMessageInfo, int]] = []
        self._unacked_lock = threading.Lock()
        self.up_bps = 0.0  # our uplink as last measured (`Probe.link`); 0.0: unknown

    @property
    def max_message(self) -> int:
        """The broker's cap on one PUBLISH packet, in bytes: the smaller of the URL's
        ``max_message`` and the CONNACK's Maximum Packet Size (0: none known)."""
        known = [b for b in (self.cfg.max_message_bytes, self.broker_max) if b > 0]
        return min(known, default=0)

    def connect(self, hooks: Hooks) -> None:
        """Connect (falling back to MQTT 3.1.1 if asked or needed) and announce presence."""
        self._hooks = hooks
        try:
            self._connect_once()
        except BrokerRefused as exc:
            if self.cfg.protocol != "auto" or "protocol" not in str(exc).lower():
                raise
            log.info("broker refused MQTT 5 (%s); falling back to 3.1.1", exc)
            self.v5 = False
            self._connect_once()

    def _connect_once(self) -> None:
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"fedring-{self.me}",
                             protocol=mqtt.MQTTv5 if self.v5 else mqtt.MQTTv311,
                             clean_session=None if self.v5 else False)  # fmt: skip
        with self._unacked_lock:
            self._unacked = []  # an old client's packets are not this one's to wait behind
        if self.cfg.username is not None:
            client.username_pw_set(self.cfg.username, self.cfg.password)
        if self.cfg.tls:
            tls_set(client, self.cfg)
        # Backoff doubles from ~1 s to 8 s; the jitter keeps a fleet from reconnecting in step.
        backoff = (1 + random.random(), self.cfg.reconnect_max_s)
        client.reconnect_delay_set(*backoff)  # type: ignore[arg-type]
        client.max_queued_messages_set(self.cfg.max_queued)
        client.max_inflight_messages_set(100)
        will_props = None
        if self.v5:  # a broker restart must not look like a death: reconnecting cancels it
            will_props = Properties(PacketTypes.WILLMESSAGE)
            will_props.WillDelayInterval = self.cfg.will_delay_s
        client.will_set(topics.status(self.me), self.status("lost"), 1, True,
                        properties=will_props)  # fmt: skip
        client.on_connect, client.on_disconnect = self._on_connect, self._on_disconnect
        client.on_message, client.on_publish = self._on_message, self._on_ack
        client.on_subscribe = self._on_suback
        client.on_log = self._on_log
        client.message_callback_add(topics.status(self.me), self._on_own_status)  # issue 27
        self.client = client
        self._ready.clear()
        props = None
        if self.v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.cfg.session_expiry_s
        open_socket(client, self.cfg, props)
        client.loop_start()
        if not self._ready.wait(self.cfg.connect_timeout_s):
            self._stop_client()
            raise BrokerUnreachable(
                f"no answer from broker {self.cfg.url} within {self.cfg.connect_timeout_s:g} s "
                "(is mosquitto running, and is the host and port right?)"
            )
        ok, reason = self._connack or (False, "no CONNACK")
        if not ok:
            self._stop_client()
            if reason.startswith("TLS"):
                raise BrokerTlsError(f"broker {self.cfg.url}: {reason}{tls_hint(self.cfg, reason)}")
            who = f" as user {self.cfg.username!r}" if self.cfg.username else " anonymously"
            raise BrokerRefused(f"broker {self.cfg.url} refused {self.me!r}{who}: {reason}")

    def status(self, state: str) -> bytes:
        """Our presence document: `state`, our session, our keep-alive (watchers' silence
        limit) and our job, if we were given one."""
        doc: dict[str, Any] = {"state": state, "session": self.session, "ts": time.time(),
                               "keepalive": self.cfg.keepalive}  # fmt: skip
        if self.job is not None:
            doc["job"] = self.job
        return json.dumps(doc).encode()

    # -- paho's thread ------------------------------------------------------------------

    def _on_log(self, _c: mqtt.Client, _u: Any, level: int, text: str) -> None:
        """Before the first CONNACK, a TLS error on the socket is the broker's answer: a
        missing client certificate shows only here, when the broker's alert is read."""
        tls = "SSL" in text or "_ssl.c" in text
        if level == mqtt.MQTT_LOG_ERR and tls and not self._ready.is_set():
            self._connack = (False, f"TLS: {text}")
            self._ready.set()

    def _on_connect(self, client: mqtt.Client, _u: Any, _f: Any, rc: Any, props: Any) -> None:
        if rc.is_failure:
            self._connack = (False, str(rc))
            self._ready.set()
            return
        self._read_connack(props)
        self._largest = 0
        sock = client.socket()
        if isinstance(sock, socket.socket):  # small QoS 1 frames: Nagle would add ~40 ms each
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Under MQTT 5 a restarted process's first connect resumes its predecessor's session,
        # which cancels the predecessor's delayed will: the retained "online" it finds may
        # be a dead process's, so only a reconnect's may make it step back (`Session`).
        reconnect = self.resumed = self._connack is not None and self._connack[0]
        assert self._hooks is not None  # set by `connect`, before paho's thread starts
        self._hooks.up(client, reconnect)
        client.publish(topics.status(self.me), self.status("online"), qos=1, retain=True)
        if reconnect:
            self.counters.add("mqtt_reconnect")
            log.info("%s reconnected to %s", self.me, self.cfg.url)
        self._connack = (True, "")
        self.connected.set()
        self._ready.set()

    def _read_connack(self, props: Any) -> None:
        """What an MQTT 5 broker announced: its packet cap (we cut messages below it) and
        whether it keeps retained messages (presence and hellos need them)."""
        if not self.v5 or props is None:
            return
        cap = int(getattr(props, "MaximumPacketSize", 0) or 0)
        if cap != self.broker_max:
            log.info("broker %s takes packets of at most %d bytes: larger messages leave "
                     "in parts", self.cfg.url, cap)  # fmt: skip
        self.broker_max = cap
        if getattr(props, "RetainAvailable", 1) == 0:
            self.counters.add("mqtt_no_retain")
            log.error("broker %s does not keep retained messages: fedring's presence and "
                      "hellos need them (docs/operations/brokers.md)", self.cfg.url)  # fmt: skip

    def _on_disconnect(self, _c: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        self.connected.clear()
        if self._hooks is not None:
            self._hooks.down()
        if not self.closed and self._connack is not None and self._connack[0]:
            self.counters.add("mqtt_disconnect")
            log.warning("%s lost the broker %s (%s); reconnecting", self.me, self.cfg.url, rc)
            self._suspect_cap(rc)

    def _suspect_cap(self, rc: Any) -> None:
        """Name the likely cause of a drop after a big packet. An MQTT 5 broker says
        "Packet too large"; a 3.1.1 one just closes the connection, which a broker restart
        does too (so that is only a warning), and paho then resends the message at every
        reconnect."""
        if getattr(rc, "value", None) == PACKET_TOO_LARGE:
            log.error("%s: broker %s dropped us for a packet of %d bytes over its cap%s",
                      self.me, self.cfg.url, self._largest,
                      "" if self.max_message else ": connect with ?protocol=auto so that it "
                      "announces its cap, or give it in the URL (?max_message=128k)")  # fmt: skip
            self.counters.add("mqtt_drop_after_large")
        elif not self.v5 and not self.max_message and self._largest > SUSPECT_CAP:
            log.warning("%s: broker %s dropped us after a packet of %d bytes: if it caps "
                        "packet size (AWS IoT Core: 128 KB), give the cap in the broker URL, "
                        "e.g. ?max_message=128k", self.me, self.cfg.url, self._largest)  # fmt: skip
            self.counters.add("mqtt_drop_after_large")

    def _on_suback(self, _c: mqtt.Client, _u: Any, mid: int, codes: Any, _p: Any) -> None:
        if self._hooks is not None:
            self._hooks.subscribed(mid, not any(getattr(c, "is_failure", False) for c in codes))

    def _on_ack(self, client: mqtt.Client, _u: Any, mid: int, rc: Any, _p: Any) -> None:
        quick_ack(client)
        if getattr(rc, "is_failure", False):  # MQTT 5: the broker took it but dropped it
            self.counters.add("mqtt_publish_refused")
            log.error("%s: broker %s refused message %d: %s (too large? see "
                      "docs/operations/brokers.md)", self.me, self.cfg.url, mid, rc)  # fmt: skip

    def _on_own_status(self, client: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        assert self._hooks is not None
        self._hooks.own_status(client, msg)

    def _on_message(self, client: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        quick_ack(client)
        try:
            assert self._hooks is not None
            payload = bytes(msg.payload)
            whole = self._join(msg.topic, payload, msg.retain) if is_part(payload) else payload
            if whole is not None:
                self._hooks.received(msg.topic, whole, bool(msg.retain))
        except Exception as exc:  # a callback that raises would stop paho's network loop
            # Whoever found an input that makes a handler raise can send it in a loop: the
            # counter counts each, the log holds a few tracebacks per (kind of topic, error).
            self.counters.add("mqtt_callback_error")
            self.errors.exception(topic_kind(msg.topic), type(exc).__name__,
                                   "%s: error handling a message on %s", self.me,
                                   msg.topic)  # fmt: skip

    def _join(self, topic: str, part: bytes, retained: bool) -> bytes | None:
        """The message `part` completes (None until then, or if it is refused)."""
        abandoned = self._joiner.abandoned
        try:
            if retained:  # we never retain parts: only the last would be kept
                raise PartError(f"retained part on {topic}")
            return self._joiner.add(topic, part)
        except PartError as exc:
            self.counters.add("mqtt_part_refused")
            self._log.warning(topic, "mqtt_part_refused", "%s refused a message part: %s",
                              self.me, exc)  # fmt: skip
            return None
        finally:
            if (gave_up := self._joiner.abandoned - abandoned) > 0:
                self.counters.add("mqtt_part_abandoned", gave_up)
                self._log.warning(topic, "mqtt_part_abandoned", "%s gave up %d incomplete "
                                  "multi-part message(s) to stay within its bounds (%d held, "
                                  "%d bytes), at a part on %s", self.me, gave_up,
                                  self._joiner.pending, self._joiner.held_bytes, topic)  # fmt: skip

    # -- the caller's thread ------------------------------------------------------------

    def publish(self, topic: str, data: bytes, deadline: Deadline, *, retain: bool = False) -> None:
        """QoS 1 publish, in parts if it exceeds the broker's cap (`max_message`) or, not
        retained, what our uplink sends in half a keep-alive (`uplink_part`); waits for
        room in the outgoing queue until `deadline`. Never QoS 2: some brokers (AWS IoT
        Core) refuse it."""
        if self.closed or self.client is None:
            raise EndpointClosed(f"link {self.me!r} is closed")
        cap, size = self.max_message, packet_size(topic, len(data), self.v5)
        if cap and size > cap and retain:
            self.counters.add("mqtt_too_large")
            raise MessageTooLarge(
                f"retained message of {len(data)} bytes on {topic} exceeds the broker's "
                f"packet cap of {cap} bytes (max_message): a retained message cannot be "
                "sent in parts"
            )
        if not retain:  # and the part our uplink sends well within a keep-alive
            cap = min((c for c in (cap, self.uplink_part()) if c), default=0)
        if cap and size > cap:
            try:
                parts = split_message(topic, data, cap, next(self._msg_ids))
            except PartError as exc:
                raise MessageTooLarge(f"{exc} (max_message)") from None
            self.counters.add("mqtt_parts_sent", len(parts))
        else:
            parts = [data]
        # before the packet goes: a broker that drops us for it may do so before
        # `_publish_one` returns, and the drop is read against this (`_suspect_cap`)
        self._largest = max(self._largest, packet_size(topic, len(parts[0]), self.v5))
        for part in parts:
            self._publish_one(topic, part, deadline, retain)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += sum(map(len, parts))

    def _publish_one(self, topic: str, data: bytes, deadline: Deadline, retain: bool) -> None:
        assert self.client is not None  # checked by `publish`
        while True:
            info = self.client.publish(topic, data, qos=1, retain=retain)
            if info.rc == mqtt.MQTT_ERR_SUCCESS or info.rc == mqtt.MQTT_ERR_NO_CONN:
                if info.rc == mqtt.MQTT_ERR_SUCCESS:  # NO_CONN: queued, sent once we reconnect
                    with self._unacked_lock:  # (paho cannot say when: not counted)
                        self._unacked = [*self._prune(), (info, len(data) + len(topic))]
                break
            if info.rc != mqtt.MQTT_ERR_QUEUE_SIZE:
                raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
            if deadline.expired:
                self.counters.add("send_queue_full")
                raise TransportTimeout(f"outgoing queue of {self.me!r} stayed full")
            time.sleep(0.005)

    def uplink_part(self) -> int:
        """The largest packet our uplink, as last measured, sends in UPLINK_PART_KEEPALIVES
        of a keep-alive (0: unmeasured). paho takes a connection for dead when nothing
        comes back a keep-alive after its ping, and its ping waits behind what we send:
        a longer packet dropped us, and QoS 1 sent it again after the reconnect, for ever.
        Cut there, each part's acknowledgement comes back in time."""
        if self.up_bps <= 0:
            return 0
        return max(MIN_UPLINK_PART, int(self.up_bps * self.cfg.keepalive * UPLINK_PART_KEEPALIVES))

    def unacked_bytes(self) -> int:
        """Bytes of our QoS 1 packets the broker has not acknowledged yet: a beat
        published now reaches the broker only after them (`Heartbeat.ahead`)."""
        with self._unacked_lock:
            self._unacked = self._prune()
            return sum(n for _, n in self._unacked)

    def _prune(self) -> list[tuple[mqtt.MQTTMessageInfo, int]]:
        return [(info, n) for info, n in self._unacked if not info.is_published()]

    def _stop_client(self) -> None:
        if self.client is not None:
            self.client.loop_stop()
            self.client.disconnect()


def topic_kind(topic: str) -> str:
    """A topic without its ids, ``jobs/+/to`` or ``agents/+/beat`` ("other" outside
    ``fedring/v1``): a key that senders and jobs named in the topic cannot multiply.

    >>> topic_kind("fedring/v1/jobs/job1/to/a2/a1"), topic_kind("fedring/v1/agents/a1/beat")
    ('jobs/+/to', 'agents/+/beat')
    """
    levels = topic.split("/")
    if len(levels) >= 5 and "/".join(levels[:2]) == topics.ROOT:
        return f"{levels[2]}/+/{levels[4]}"  # both fixed by our subscriptions
    return "other"


def quick_ack(client: mqtt.Client) -> None:
    """ACK what the broker sent now (Linux's TCP_QUICKACK; it lapses, so it is re-armed
    after every packet we read): a broker that Nagles waits for our ACK before its next
    small write, and a delayed ACK makes that wait ~40 ms (`NAGLE_STALL_S`)."""
    sock = client.socket()
    if isinstance(sock, socket.socket) and hasattr(socket, "TCP_QUICKACK"):
        with contextlib.suppress(OSError):  # closing under us: the next connection re-arms it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

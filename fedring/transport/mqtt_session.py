"""One process per id at the broker, and a goodbye that leaves nothing behind (issue 27).

The broker keeps a persistent session per client id, and hands it to whoever connects
with that id next. `Session` guards our hold on it: a link that finds another process
holding its id steps back (two holders would take the session from each other at every
reconnect, for as long as both live), and a clean goodbye clears the session with a
clean-session connect, so that neither a queued backlog nor a stale will outlives it.

Locking: `step_back` runs on paho's thread, `close` and `kill` on the owner's; they meet
only at `Connection.closed`, set once and never cleared.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from fedring.transport import topics
from fedring.transport.base import TransportError
from fedring.transport.mqtt_broker import tls_set
from fedring.transport.mqtt_connection import Connection
from fedring.transport.mqtt_presence import MAX_STATUS_BYTES
from fedring.wire.jsondoc import parse_document

log = logging.getLogger("fedring.transport.mqtt")


class Session:
    """Our hold on our id at the broker; `stop` is called whenever the link closes for good
    (it ends our heartbeats)."""

    def __init__(self, conn: Connection, stop: Callable[[], None]) -> None:
        self.conn, self._stop = conn, stop
        self.taken_over = ""  # why we stepped back for another holder of our id ("": never)

    def step_back(self, client: mqtt.Client, msg: mqtt.MQTTMessage) -> None:
        """Our presence as the broker retained it when we (re)subscribed: "online" under
        another session means another process connected with our id and holds it (the
        broker handed it our session). Step back: its presence is put back as it was and
        we leave without a will; the owner reads `taken_over`."""
        conn = self.conn
        try:
            if not msg.retain or conn.closed or (conn.v5 and not conn.resumed):
                return
            try:
                doc = parse_document(msg.payload, max_bytes=MAX_STATUS_BYTES, what="status")
            except ValueError:  # a FrameError: not a presence a link of ours wrote
                return
            session = str(doc.get("session", ""))
            if doc.get("state") != "online" or session in ("", conn.session):
                return
            self.taken_over = (
                f"another process holds the id {conn.me!r} at {conn.cfg.url} (session "
                f"{session}); this one ({conn.session}) stepped back (if no other process "
                f"holds it, clear its presence: mosquitto_pub -r -n -t {msg.topic})"
            )
            log.error("%s", self.taken_over)
            conn.counters.add("id_taken_over")
            conn.closed = True
            self._stop()
            client.publish(msg.topic, msg.payload, qos=1, retain=True)
            client.disconnect()
        except Exception as exc:  # a callback that raises would stop paho's network loop
            conn.counters.add("mqtt_callback_error")
            conn.errors.exception("own presence", type(exc).__name__,
                                  "%s: error reading its own presence", conn.me)  # fmt: skip

    def close(self, state: str = "offline") -> None:
        """Say goodbye (retained status), then disconnect."""
        conn, client = self.conn, self.conn.client
        if conn.closed or client is None:
            return
        try:
            info = client.publish(topics.status(conn.me), conn.status(state), 1, True)
            info.wait_for_publish(2.0)
        except (RuntimeError, ValueError):
            pass
        conn.closed = True
        self._stop()
        props = None
        if conn.v5:  # the broker forgets our session with this goodbye
            props = Properties(PacketTypes.DISCONNECT)
            props.SessionExpiryInterval = 0
        client.disconnect(properties=props)
        client.loop_stop()
        # Also under MQTT 5: the broker may read a newcomer's CONNECT before our
        # DISCONNECT (seen under load); a clean connect that it answers leaves no doubt.
        self._forget(conn.status(state))

    def _forget(self, goodbye: bytes) -> None:
        """The broker keeps a persistent session (and queues what its subscriptions match)
        until a clean-session connect with our id: make one, so that a clean goodbye
        leaves nothing behind (a crashed link's session is left to the broker's
        ``persistent_client_expiration``).

        If the broker reads this connect before our DISCONNECT, it takes the old
        connection over and sends its will ("lost"): the clean session says `goodbye`
        again, after the takeover, so the retained status is the goodbye."""
        cfg, me = self.conn.cfg, self.conn.me
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"fedring-{me}",
                             protocol=mqtt.MQTTv311, clean_session=True)  # fmt: skip
        if cfg.username is not None:
            client.username_pw_set(cfg.username, cfg.password)
        answered = threading.Event()
        client.on_connect = lambda *_args: answered.set()
        try:
            if cfg.tls:
                tls_set(client, cfg)
            client.connect(cfg.host, cfg.port, keepalive=cfg.keepalive)
            client.loop_start()
            if answered.wait(2.0):
                info = client.publish(topics.status(me), goodbye, qos=1, retain=True)
                info.wait_for_publish(2.0)
                client.disconnect()
            client.loop_stop()
        except (OSError, RuntimeError, TransportError, ValueError) as exc:  # gone: the expiry's job
            log.info("%s: could not clear its broker session (%s)", me, exc)

    def kill(self) -> None:
        """Drop the connection without a goodbye (tests): the broker sends our will."""
        self.conn.closed = True
        self._stop()
        client = self.conn.client
        if client is not None:
            client.loop_stop()
            sock = client.socket()
            if sock is not None:
                sock.close()

"""What one MQTT link's path through the broker is worth: round trip, bandwidth, Nagle.

`Probe` measures the link on its own probe topic (``agents/{id}/probe``, which only it
subscribes to; the router hands it the echoes) and checks whether the broker delays
small messages (Nagle) with two throwaway clients.

A broker that Nagles its writes (Mosquitto without `set_tcp_nodelay true`) holds a
small message to a client until the client ACKs the one before, and the client's
delayed ACK makes that ~40 ms a message. Measured on loopback (Mosquitto 2.0.11,
Linux 6.18, 2 cores shared with load averages of 7-15): two clients ping-ponging
100-byte QoS 1 messages took 41-55 ms an exchange without the option (every one of
120; the fastest of three: 34-50 ms over 30 checks) and 0.2-0.5 ms with it (spikes
to 21 ms; the fastest of a check: 0.3-8.3 ms over 30). One connection alone shows
nothing (its own echoes took 0.1-0.5 ms either way: the broker's answers to one
client go out together), so two throwaway clients exchange up to NAGLE_EXCHANGES
messages, and the broker Nagles only if even the fastest took NAGLE_STALL_S: one
fast exchange ends the check (~5 ms in all; ~140 ms on a Nagle broker).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fedring.transport import topics
from fedring.transport.base import Deadline, TransportError
from fedring.transport.mqtt_broker import BrokerConfig
from fedring.transport.mqtt_connection import Connection

log = logging.getLogger("fedring.transport.mqtt")

NAGLE_EXCHANGES = 3
NAGLE_STALL_S = 0.025
NAGLE_CHECK_S = 1.5  # the check's own deadline: connects and exchanges
NAGLE_FIX = ("broker delays small messages (Nagle): add `set_tcp_nodelay true` to "
             "mosquitto.conf; see docs/operations/troubleshooting.md")  # fmt: skip


class Probe:
    """Measurements of `conn`'s link; `seen` takes the echoes of our probe topic."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.seen: queue.Queue[bytes] = queue.Queue()
        self.broker_nagle: bool | None = None  # `check_nagle`'s finding (None: unchecked)

    def link(self, total: int, piece: int) -> dict[str, float]:
        """See `MqttLink.probe_link`."""
        out = {"rtt_s": 0.0, "up_bps": 0.0, "down_bps": 0.0, "link_bps": 0.0}
        conn, client = self.conn, self.conn.client
        if conn.closed or client is None:
            return out
        nagle = self.check_nagle() if self.broker_nagle is None else self.broker_nagle
        out["broker_nagle"] = 1.0 if nagle else 0.0
        while not self.seen.empty():
            self.seen.get_nowait()
        topic, deadline = topics.probe(conn.me), Deadline.after(10.0)
        try:
            rtts = []
            for _ in range(3):
                start = time.perf_counter()
                conn.publish(topic, b"rtt", deadline)
                self.seen.get(timeout=deadline.remaining() or 1e-3)
                rtts.append(time.perf_counter() - start)
            rtt = min(rtts)
            pieces = max(1, total // piece)
            start = time.perf_counter()
            infos = [client.publish(topic, bytes(piece), qos=1) for _ in range(pieces)]
            for info in infos:
                info.wait_for_publish(timeout=deadline.remaining() or 1e-3)
            up = time.perf_counter() - start
            for _ in range(pieces):
                self.seen.get(timeout=deadline.remaining() or 1e-3)
            both = time.perf_counter() - start
        except (queue.Empty, TransportError, RuntimeError, ValueError):
            return out
        conn.stats.frames_sent += 3 + pieces
        conn.stats.bytes_sent += 9 + pieces * piece
        size = pieces * piece
        up_bps = size / max(up - rtt, 1e-6)
        conn.up_bps = up_bps  # what our beats' ``busy`` is reckoned at (`Heartbeat.ahead`)
        return {**out, "rtt_s": rtt, "up_bps": up_bps, "down_bps": down_bps(size, piece,
                up_bps, both - rtt), "link_bps": size / max(both, 1e-9)}  # fmt: skip

    def check_nagle(self) -> bool | None:
        """See `MqttLink.check_broker_nagle`."""
        conn = self.conn
        if conn.cfg.username is not None or conn.closed:
            return None
        fastest = _nagle_exchange(conn.cfg, conn.me)
        if fastest is None:
            return None
        self.broker_nagle = fastest >= NAGLE_STALL_S
        if self.broker_nagle:
            conn.counters.add("broker_nagle")
            log.warning("%s: %s (a small message there and back took %.0f ms at best)",
                        conn.me, NAGLE_FIX, fastest * 1e3)  # fmt: skip
        return self.broker_nagle


def down_bps(size: int, piece: int, up_bps: float, seconds: float) -> float:
    """The down link's bytes per second from a pipelined echo of `size` bytes in
    `piece`s that took `seconds` (less one round trip) to come back in full.

    The broker forwards each piece once it has it, so when the down link is the
    slower the echo takes ``piece/up + size/down``. When it is the faster, the up link
    paces the echo and the down link's own rate cannot be told apart from noise (one
    piece's worth): it is taken to be the up link's, a lower bound.
    """
    slower = seconds - piece / up_bps
    return min(size / slower, up_bps) if slower > 0 else up_bps


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

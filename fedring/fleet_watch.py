"""A read-only look at a broker's fleet: every board's hello, status and beats.

`FleetReader` connects under a throwaway client id with a clean session (as
`transport.mqtt_peek` does), publishes nothing, leaves no will and no session, and
subscribes at QoS 0 to every agent's hello, status and beat, which it hands to a
`fleet.BoardTable`. It is not an `MqttLink`: a link is an identity (a retained
presence, a will, beats of its own, a persistent session) that every coordinator would
count among its peers, and it needs write rights an operator's user may well lack.

A broker that binds client ids to user names (examples/mosquitto.conf) gives the reader
its user's name as client id: connected as an agent's or the coordinator's user, it
would throw that process off the broker. So `fedring fleet` refuses the coordinator's
name, and an operator gets a read-only user of its own (``user operator`` in
examples/mosquitto.acl).

Mosquitto 2.0 grants a subscription its ACL denies and then delivers nothing, so a user
who may not read beats or hellos learns it only from their absence
(`BoardTable.warnings`); a SUBACK that does refuse a filter is kept in `refused`.

Threads: paho's network thread runs the callbacks and feeds the table (which has its
own lock); `refused` is appended there and read by the caller after `retained_in`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fedring.fleet import BoardTable
from fedring.logs_limit import LogLimiter
from fedring.transport import topics
from fedring.transport.mqtt_broker import (
    BrokerConfig,
    BrokerRefused,
    BrokerUnreachable,
    open_socket,
    tls_set,
)

log = logging.getLogger(__name__)
FILTERS = tuple(f"{topics.ROOT}/agents/+/{leaf}" for leaf in ("hello", "status", "beat"))


class FleetReader:
    """Feeds `table` from the broker in `cfg` until `close`."""

    def __init__(self, cfg: BrokerConfig, table: BoardTable,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.cfg, self.table, self.clock = cfg, table, clock
        self._log = LogLimiter(log, "messages on foreign topics")
        self.refused: list[str] = []  # filters the broker's SUBACK refused
        self.retained_in = threading.Event()  # what the broker retained has reached us
        self._ready = threading.Event()
        self._connack: tuple[bool, str] | None = None
        self._client: mqtt.Client | None = None
        self._sync = f"{topics.ROOT}/fleet-sync/{os.urandom(4).hex()}"

    def start(self) -> FleetReader:
        """Connect and subscribe; a `BrokerUnreachable` or `BrokerRefused` (its
        `BrokerTlsError` too) says why not."""
        cfg = self.cfg
        client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311,
                             client_id=f"fedring-fleet-{os.urandom(4).hex()}",
                             clean_session=True)  # fmt: skip
        if cfg.username is not None:
            client.username_pw_set(cfg.username, cfg.password)
        if cfg.tls:
            tls_set(client, cfg)
        client.reconnect_delay_set(1, int(cfg.reconnect_max_s))
        client.on_connect, client.on_disconnect = self._on_connect, self._on_disconnect
        client.on_subscribe, client.on_unsubscribe = self._on_subscribe, self._on_unsubscribe
        client.on_message = self._on_message
        self._client = client
        open_socket(client, cfg, None)
        client.loop_start()
        if not self._ready.wait(cfg.connect_timeout_s):
            self.close()
            raise BrokerUnreachable(
                f"no answer from broker {cfg.url} within {cfg.connect_timeout_s:g} s "
                "(is mosquitto running, and is the host and port right?)"
            )
        ok, reason = self._connack or (False, "no CONNACK")
        if not ok:
            self.close()
            who = f"user {cfg.username!r}" if cfg.username else "an anonymous client"
            raise BrokerRefused(f"broker {cfg.url} refused {who}: {reason}")
        return self

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()

    # -- paho's thread ------------------------------------------------------------------

    def _on_connect(self, client: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        if rc.is_failure:
            self._connack = (False, str(rc))
            self._ready.set()
            return
        self.table.listening(self.clock())
        client.subscribe([(f, 0) for f in FILTERS])
        self._connack = (True, "")
        self._ready.set()

    def _on_subscribe(self, client: mqtt.Client, _u: Any, _mid: int, codes: list[Any],
                      _p: Any) -> None:  # fmt: skip
        for topic, code in zip(FILTERS, codes, strict=False):
            if code.is_failure and topic not in self.refused:
                self.refused.append(topic)
                log.warning("broker %s refused a subscription to %s: %s",
                            self.cfg.url, topic, code)  # fmt: skip
        # The broker answers an unsubscription after sending what the subscription
        # retained (`mqtt_peek`); one from a topic we never held changes nothing.
        client.unsubscribe(self._sync)

    def _on_unsubscribe(self, *_: Any) -> None:
        self.retained_in.set()

    def _on_disconnect(self, *_: Any) -> None:
        self.table.paused()

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            self._route(msg.topic, bytes(msg.payload))
        except Exception:  # a callback that raises would stop paho's network loop
            self.table.counters.add("fleet_callback_error")
            log.exception("error reading a message on %r", msg.topic[:200])

    def _route(self, topic: str, payload: bytes) -> None:
        parsed = topics.parse_agent_topic(topic)
        if parsed is None:
            self.table.counters.add("bad_topic")
            self._log.warning(topic[:200], "bad_topic", "a message on %r: not an agent's topic",
                              topic[:200])  # fmt: skip
            return
        who, leaf = parsed
        try:
            topics.check_id("agent", who)
        except topics.TopicError:
            self.table.counters.add("bad_topic")
            self._log.warning(topic[:200], "bad_topic", "a message on %r: not an agent id",
                              topic[:200])  # fmt: skip
            return
        now = self.clock()
        if leaf == "hello":
            self.table.hello(who, payload, now)
        elif leaf == "status":
            self.table.status(who, payload, now)
        elif leaf == "beat":
            self.table.beat(who, payload, now)

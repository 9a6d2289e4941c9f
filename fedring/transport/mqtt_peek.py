"""A look at what a broker retains, under a throwaway client id that leaves no session.

Connecting as a link's own id (``fedring-{id}``) to read its retained presence would
take over a live holder's session; `peek_retained` reads under a random id, with a
clean session, publishes nothing but the empty payloads it is asked to retain (to
clear topics), and disconnects. Used by the coordinator's lease (is a coordinator
online? which manifests did crashed ones leave?) and by `fedring.connect` (does
another process hold this agent's id?).
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Sequence
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from fedring.transport.mqtt_broker import (
    BrokerConfig,
    BrokerRefused,
    BrokerTlsError,
    BrokerUnreachable,
)


def peek_retained(
    cfg: BrokerConfig, filters: list[str], clear: Sequence[str] = (), *, who: str = "the look"
) -> dict[str, bytes]:
    """The messages retained on `filters` (topic -> payload), read under a throwaway
    client id that leaves no session; then empty the retained `clear` topics. A
    refusal is a `BrokerRefused` naming `who` was refused."""
    seen: dict[str, bytes] = {}
    refused: list[str] = []
    done = threading.Event()

    def on_connect(client: mqtt.Client, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
        if rc.is_failure:
            refused.append(str(rc))
            done.set()
        elif filters:  # QoS 0: what is retained is not held back behind in-flight limits
            client.subscribe([(f, 0) for f in filters])
        else:
            done.set()

    def on_message(_c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.retain and msg.payload:
            seen[msg.topic] = bytes(msg.payload)

    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311, clean_session=True,
                         client_id=f"fedring-peek-{os.urandom(4).hex()}")  # fmt: skip
    if cfg.username is not None:
        client.username_pw_set(cfg.username, cfg.password)
    client.on_connect, client.on_message = on_connect, on_message
    # The broker answers a subscription after sending what it retained, and the
    # unsubscription after that: once it is answered, everything retained is in.
    client.on_subscribe = lambda c, *_: c.unsubscribe(filters)
    client.on_unsubscribe = lambda *_: done.set()
    client.connect_timeout = cfg.connect_timeout_s
    try:
        if cfg.tls:
            client.tls_set(ca_certs=cfg.ca, certfile=cfg.cert, keyfile=cfg.key)
        client.connect(cfg.host, cfg.port, keepalive=max(cfg.keepalive, 5))
    except ssl.SSLError as exc:  # the link names the file at fault: let it say so
        raise BrokerTlsError(f"TLS with broker {cfg.url} failed: {exc}") from None
    except (OSError, ValueError) as exc:
        raise BrokerUnreachable(f"broker {cfg.url}: {exc}") from exc
    client.loop_start()
    try:
        if not done.wait(cfg.connect_timeout_s):
            raise BrokerUnreachable(
                f"no answer from broker {cfg.url} within {cfg.connect_timeout_s:g} s"
            )
        for topic in clear:
            client.publish(topic, b"", qos=1, retain=True).wait_for_publish(cfg.connect_timeout_s)
    finally:
        client.disconnect()
        client.loop_stop()
    if refused:
        raise BrokerRefused(f"broker {cfg.url} refused {who}: {refused[0]}")
    return seen

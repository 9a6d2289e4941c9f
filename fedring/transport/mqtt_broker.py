"""Where the MQTT broker is, how to reach it, and how it says no.

`BrokerConfig` is a link's whole configuration (parsed from ``mqtt://`` or ``mqtts://``
URLs); the exceptions name what went wrong at connect; `tls_set` and `tls_hint` load
TLS files and turn an SSL error into the likely fix; `open_socket` opens the TCP
connection and names what refused it. `fedring.transport.mqtt` re-exports
everything here.
"""

from __future__ import annotations

import os
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties

from fedring.transport.base import Deadline, TransportError


class BrokerUnreachable(TransportError):
    """No connection to the broker before the deadline."""


class BrokerRefused(TransportError):
    """The broker answered but refused us: credentials, ACL or protocol."""


class BrokerTlsError(BrokerRefused):
    """TLS failed: an unreadable CA/certificate/key file, a broker certificate our CA does
    not trust, or a broker that wants a client certificate we did not give."""


class MessageTooLarge(TransportError):
    """A message the broker would refuse for its size, and that cannot be cut into parts
    (a retained one: only the last part would be kept)."""


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
    # The broker's cap on one PUBLISH packet, in bytes (0: none known). An MQTT 5 broker
    # announces its own in the CONNACK, and the smaller of the two holds; a message over
    # it is cut into parts (`mqtt_parts`). From the URL: ``?max_message=128k``.
    max_message_bytes: int = 0

    @classmethod
    def parse(cls, url: str, **options: Any) -> BrokerConfig:
        """``mqtt://HOST[:PORT]`` (1883) or ``mqtts://HOST[:PORT]`` (8883, TLS), with
        optional query options ``max_message`` (the broker's packet cap: bytes, or with a
        ``k``/``m`` suffix for KiB/MiB) and ``protocol`` (``3.1.1``, ``5`` or ``auto``).

        >>> BrokerConfig.parse("mqtt://h?max_message=128k&protocol=auto").max_message_bytes
        131072
        """
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
        return cls(parts.hostname, port, tls=tls, **{**_query_options(url, parts.query),
                                                     **options})  # fmt: skip

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


# The link's bandwidth probe publishes 64 KiB pieces whole: a smaller cap would refuse them.
MIN_MAX_MESSAGE = 64 * 1024 + 1024
_PROTOCOLS = ("auto", "5", "3.1.1")


def _query_options(url: str, query: str) -> dict[str, Any]:
    """The broker URL's query options as `BrokerConfig` fields; a bad one is named."""
    options: dict[str, Any] = {}
    for name, values in parse_qs(query, keep_blank_values=True, strict_parsing=False).items():
        value = values[-1]
        if name == "max_message":
            options["max_message_bytes"] = _size(url, value)
        elif name == "protocol":
            if value not in _PROTOCOLS:
                raise ValueError(f"--broker {url!r}: protocol={value!r} must be one of "
                                 f"{', '.join(_PROTOCOLS)}")  # fmt: skip
            options["protocol"] = value
        else:
            raise ValueError(f"--broker {url!r}: unknown option {name!r} (known: max_message, "
                             "protocol)")  # fmt: skip
    return options


def _size(url: str, text: str) -> int:
    scale = {"k": 1024, "m": 1024 * 1024}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) * scale < MIN_MAX_MESSAGE:
        raise ValueError(
            f"--broker {url!r}: max_message={text!r} must be a size of at least "
            f"{MIN_MAX_MESSAGE} bytes (a number, or with k or m for KiB or MiB)"
        )
    return int(digits) * scale


def tls_set(client: mqtt.Client, cfg: BrokerConfig) -> None:
    """Load `cfg`'s TLS files into `client`, naming the option of a missing or bad one."""
    for option, path in (("--ca", cfg.ca), ("--cert", cfg.cert), ("--key", cfg.key)):
        if path is not None and not os.path.isfile(path):
            raise BrokerTlsError(f"{option} {path!r}: no such file")
    try:
        client.tls_set(ca_certs=cfg.ca, certfile=cfg.cert, keyfile=cfg.key)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError: a bad PEM file
        files = f"--ca {cfg.ca!r}, --cert {cfg.cert!r}, --key {cfg.key!r}"
        raise BrokerTlsError(f"cannot load TLS files ({files}): {exc}") from None


def tls_hint(cfg: BrokerConfig, error: str) -> str:
    """The likely fix for a TLS `error` at connect ("" if none comes to mind)."""
    if "CERTIFICATE_VERIFY_FAILED" in error:
        return (f" (is the broker's certificate signed by --ca {cfg.ca!r}, and does it "
                f"name {cfg.host!r}?)")  # fmt: skip
    rejected = ("CERTIFICATE_REQUIRED", "EOF occurred", "UNKNOWN_CA", "BAD_CERTIFICATE")
    if cfg.cert is not None and any(code in error for code in rejected):
        # We did send one (an untrusted one reads as EOF, the alert lost in the close)
        return (f" (the broker does not trust the client certificate --cert "
                f"{cfg.cert!r}: is it signed by a CA in the broker's cafile, "
                "and still valid?)")  # fmt: skip
    if "CERTIFICATE_REQUIRED" in error:
        return " (the broker wants a client certificate: give --cert and --key)"
    if "EOF occurred" in error:  # the broker's alert lost in the race with its close
        return (" (the broker closed the TLS session unanswered: does it want a client "
                "certificate? give --cert and --key, signed by a CA it trusts)")  # fmt: skip
    if "UNKNOWN_CA" in error or "BAD_CERTIFICATE" in error:
        return f" (the broker does not trust the client certificate --cert {cfg.cert!r})"
    return ""


# A refused connection is retried this long (a broker starting up), then reported.
REFUSED_RETRY_S = 1.0


def open_socket(client: mqtt.Client, cfg: BrokerConfig, props: Properties | None) -> None:
    """Open `client`'s TCP connection (and TLS handshake) here, where their errors can be
    named; the broker's CONNACK comes later, on paho's thread. A refused connection is
    answered at once: retry it briefly (a broker starting up), then say so, rather than
    wait out connect_timeout_s (issue 27). No route or no answer yet: paho retries in
    the background until the caller's deadline."""
    where, keepalive = (cfg.host, cfg.port), cfg.keepalive
    refused_until = Deadline.after(min(REFUSED_RETRY_S, cfg.connect_timeout_s))
    pause = 0.1
    while True:
        try:
            client.connect(*where, keepalive=keepalive, properties=props)
        except ssl.SSLError as exc:
            raise BrokerTlsError(f"TLS handshake with broker {cfg.url} failed: {exc}"
                                 f"{tls_hint(cfg, str(exc))}") from None  # fmt: skip
        except ConnectionRefusedError as exc:
            if refused_until.expired:
                raise BrokerUnreachable(
                    f"broker {cfg.url} refused the connection ({exc}): is mosquitto "
                    "running, and is the host and port right?"
                ) from None
            time.sleep(min(pause * (1 + random.random()), refused_until.remaining()))
            pause *= 2
            continue
        except OSError:
            client.connect_async(*where, keepalive=keepalive, properties=props)
        except ValueError as exc:
            raise BrokerUnreachable(f"broker {cfg.url}: {exc}") from exc
        return

"""A small MQTT 3.1.1 client on asyncio: many broker connections in one thread.

The fleet-scale load generator (`fedring.lab.loadgen`) runs hundreds of protocol
agents in one process; paho's client costs a thread a connection. This client is
only what those agents use: CONNECT with a will, SUBSCRIBE, PUBLISH at QoS 0 and 1
(ours are not retried: loopback to a local broker), PUBACK of what the broker
sends, DISCONNECT. Incoming bytes are split into packets by `PacketReader`, which
refuses a packet over its size cap (`MqttProtocolError`) rather than buffer it.

    >>> reader = PacketReader()
    >>> reader.feed(publish_packet("a/b", b"hi", qos=0) + PINGRESP)
    [(48, b'\\x00\\x03a/bhi'), (208, b'')]
    >>> parse_publish(48, b'\\x00\\x03a/bhi')
    Publish(topic='a/b', payload=b'hi', qos=0, packet_id=0, retain=False)
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass

CONNECT, CONNACK, PUBLISH, PUBACK, SUBSCRIBE, SUBACK = 1, 2, 3, 4, 8, 9
PINGREQ, PINGRESP, DISCONNECT = b"\xc0\x00", b"\xd0\x00", b"\xe0\x00"
MAX_PACKET_BYTES = 4 << 20  # a packet larger than this ends the connection (never buffered)


class MqttProtocolError(ValueError):
    """Bytes from the broker that are not MQTT 3.1.1 as this client reads it."""


def remaining_length(n: int) -> bytes:
    """MQTT's variable-length integer (1 to 4 bytes).

    >>> remaining_length(127), remaining_length(128)
    (b'\\x7f', b'\\x80\\x01')
    """
    if not 0 <= n < 1 << 28:
        raise ValueError(f"remaining length {n} is outside [0, 2**28)")
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("!H", len(data)) + data


def _packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + remaining_length(len(body)) + body


def connect_packet(
    client_id: str, keepalive: int, *, clean: bool = True,
    will: tuple[str, bytes, int, bool] | None = None,
) -> bytes:  # fmt: skip
    """CONNECT; `will` is (topic, payload, qos, retain)."""
    flags = 0x02 if clean else 0
    payload = _string(client_id)
    if will is not None:
        topic, message, qos, retain = will
        flags |= 0x04 | (qos << 3) | (0x20 if retain else 0)
        payload += _string(topic) + _string(message)
    return _packet(CONNECT << 4, _string("MQTT") + bytes([4, flags]) +
                   struct.pack("!H", keepalive) + payload)  # fmt: skip


def publish_packet(
    topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, packet_id: int = 0
) -> bytes:
    first = (PUBLISH << 4) | (qos << 1) | (1 if retain else 0)
    pid = struct.pack("!H", packet_id) if qos else b""
    return _packet(first, _string(topic) + pid + payload)


def subscribe_packet(packet_id: int, topics: list[tuple[str, int]]) -> bytes:
    body = struct.pack("!H", packet_id) + b"".join(_string(t) + bytes([q]) for t, q in topics)
    return _packet((SUBSCRIBE << 4) | 0x02, body)


def puback_packet(packet_id: int) -> bytes:
    return _packet(PUBACK << 4, struct.pack("!H", packet_id))


@dataclass(frozen=True)
class Publish:
    topic: str
    payload: bytes
    qos: int
    packet_id: int
    retain: bool


def parse_publish(first: int, body: bytes) -> Publish:
    """A PUBLISH packet's fields; `MqttProtocolError` names what does not add up."""
    qos = (first >> 1) & 0x03
    if qos > 2 or len(body) < 2:
        raise MqttProtocolError(f"PUBLISH with qos={qos} and a {len(body)}-byte body")
    (n,) = struct.unpack_from("!H", body)
    at = 2 + n + (2 if qos else 0)
    if at > len(body):
        raise MqttProtocolError(f"PUBLISH topic of {n} bytes in a {len(body)}-byte body")
    try:
        topic = body[2 : 2 + n].decode()
    except UnicodeDecodeError:
        raise MqttProtocolError("PUBLISH topic is not UTF-8") from None
    pid = struct.unpack_from("!H", body, 2 + n)[0] if qos else 0
    return Publish(topic, body[at:], qos, pid, bool(first & 0x01))


class PacketReader:
    """Splits a byte stream into (first byte, body) packets, at most `max_bytes` each."""

    def __init__(self, max_bytes: int = MAX_PACKET_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        out: list[tuple[int, bytes]] = []
        at = 0
        while len(buf) - at >= 2:
            length, mult, i, complete = 0, 1, at + 1, False
            while i < len(buf) and i - at <= 4:
                byte = buf[i]
                i += 1
                length += (byte & 0x7F) * mult
                if not byte & 0x80:
                    complete = True
                    break
                mult *= 128
            if not complete:
                if i - at > 4:
                    raise MqttProtocolError("remaining length longer than 4 bytes")
                break  # the length itself is not all here yet
            if length > self.max_bytes:
                raise MqttProtocolError(f"packet of {length} bytes > {self.max_bytes}")
            if len(buf) - i < length:
                break
            out.append((buf[at], bytes(buf[i : i + length])))
            at = i + length
        del buf[:at]
        return out


OnMessage = Callable[[str, bytes, bool], None]  # topic, payload, retained


class MqttConn(asyncio.Protocol):
    """One client connection; `on_message` runs on the event loop for every PUBLISH."""

    def __init__(self, client_id: str, on_message: OnMessage) -> None:
        self.client_id = client_id
        self.on_message = on_message
        self.transport: asyncio.Transport | None = None
        self.reader = PacketReader()
        self.connack: asyncio.Future[int] | None = None
        self.closed: asyncio.Future[None] | None = None
        self._ids = itertools.cycle(range(1, 65536))
        self._writable = asyncio.Event()
        self._writable.set()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.error = ""  # why the connection ended, if not by our DISCONNECT

    async def open(
        self, host: str, port: int, keepalive: int, *, clean: bool = True,
        will: tuple[str, bytes, int, bool] | None = None, timeout_s: float = 30.0,
    ) -> None:  # fmt: skip
        loop = asyncio.get_running_loop()
        self.connack, self.closed = loop.create_future(), loop.create_future()
        await loop.create_connection(lambda: self, host, port)
        self._write(connect_packet(self.client_id, keepalive, clean=clean, will=will))
        rc = await asyncio.wait_for(self.connack, timeout_s)
        if rc != 0:
            raise ConnectionRefusedError(f"broker refused {self.client_id!r}: CONNACK rc={rc}")

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.bytes_received += len(data)
        try:
            packets = self.reader.feed(data)
        except MqttProtocolError as exc:
            self.error = str(exc)
            assert self.transport is not None
            self.transport.abort()
            return
        for first, body in packets:
            kind = first >> 4
            if kind == PUBLISH:
                msg = parse_publish(first, body)
                if msg.qos == 1:
                    self._write(puback_packet(msg.packet_id))
                self.on_message(msg.topic, msg.payload, msg.retain)
            elif kind == CONNACK and self.connack is not None and not self.connack.done():
                self.connack.set_result(body[1] if len(body) >= 2 else 255)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and not self.error:
            self.error = str(exc)
        if self.connack is not None and not self.connack.done():
            self.connack.set_exception(ConnectionError(f"{self.client_id}: closed before CONNACK"))
        if self.closed is not None and not self.closed.done():
            self.closed.set_result(None)
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- sending --------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError(f"{self.client_id}: connection closed ({self.error or 'by us'})")
        self.bytes_sent += len(data)
        self.transport.write(data)

    async def writable(self) -> None:
        """Wait while the socket's send buffer is over its high-water mark."""
        await self._writable.wait()

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        pid = next(self._ids) if qos else 0
        self._write(publish_packet(topic, payload, qos=qos, retain=retain, packet_id=pid))

    def subscribe(self, topics: list[tuple[str, int]]) -> None:
        self._write(subscribe_packet(next(self._ids), topics))

    def unsubscribe(self, topic: str) -> None:
        body = struct.pack("!H", next(self._ids)) + _string(topic)
        self._write(_packet(0xA2, body))

    def close(self) -> None:
        """DISCONNECT (no will), then close."""
        if self.transport is not None and not self.transport.is_closing():
            self._write(DISCONNECT)
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection without DISCONNECT: the broker sends the will."""
        if self.transport is not None:
            self.transport.abort()

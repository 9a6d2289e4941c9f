"""Messages larger than the broker takes: cut into parts by the sender's link, joined
by the receiver's, so that no PUBLISH packet exceeds the broker's cap.

Brokers cap the size of one PUBLISH packet (fixed header, topic, packet id, properties
and payload together): AWS IoT Core at 128 KB, EMQX at 1 MB by default, Mosquitto at
its ``max_packet_size``. A link learns the cap from the broker's MQTT 5 CONNACK
(Maximum Packet Size) or from the broker URL (``?max_message=128k``, for MQTT 3.1.1,
which cannot announce one). Frames are sized by the job (the boards' profiles) before
any link is asked, and control messages, the model, hellos and ring chunks all leave
through the link's one `publish`: so the cut is made there, the one place that knows
both the topic and the cap. A message that fits goes out unchanged. The link cuts at
a second cap too, once its uplink is measured: what that uplink sends in half a
keep-alive (`Connection.uplink_part`), so that paho's ping, queued behind the send,
is answered in time.

A part is ``MAGIC`` (4 bytes), the message id (u64, per link), the part's index and
the part count (u32 each), then its piece. ``MAGIC`` starts with 0xC1, the one byte
that msgpack never writes: no version-1 frame (a msgpack map), compact frame (version
2 or 3), JSON presence document or empty retained clear starts with it.

The receiver joins parts per (topic, message id); the topic's last level is the
sender, which the broker's ACL binds to its user name, so no one can add parts to
another sender's message. Joining is bounded (pending messages, held bytes, parts a
message may announce; the oldest incomplete message is abandoned first), parts repeated
by QoS 1 are taken once, and the joined message is checked by the frame layer as any
other (sha256 or AEAD tag), so a forged or corrupt part costs that one message.
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field

MAGIC = b"\xc1fp1"
HEADER = struct.Struct(">4sQII")  # magic, message id, index, count
# Fixed header (1 byte + a remaining length of at most 4), topic length (2), packet id
# (2, QoS 1) and MQTT 5's property length (1; we send no properties on a publish).
_PUBLISH_OVERHEAD = 1 + 4 + 2 + 2 + 1


class PartError(ValueError):
    """A part that cannot be taken: malformed, inconsistent, or beyond the bounds."""


def packet_size(topic: str, payload: int, v5: bool) -> int:
    """Bytes of a QoS 1 PUBLISH of `payload` bytes on `topic`, as the broker measures
    it against its maximum packet size."""
    remaining = 2 + len(topic.encode()) + 2 + (1 if v5 else 0) + payload
    return 1 + _varint_len(remaining) + remaining


def _varint_len(n: int) -> int:
    return 1 if n < 128 else 2 if n < 16_384 else 3 if n < 2_097_152 else 4


def piece_bytes(topic: str, cap: int) -> int:
    """The largest piece a part on `topic` may carry under a packet cap of `cap` bytes
    (0 or less: no piece fits)."""
    return cap - _PUBLISH_OVERHEAD - len(topic.encode()) - HEADER.size


def split_message(topic: str, data: bytes, cap: int, msg_id: int) -> list[bytes]:
    """`data` cut into parts whose PUBLISH packets on `topic` fit in `cap` bytes."""
    size = piece_bytes(topic, cap)
    if size < 1:
        raise PartError(f"a broker cap of {cap} bytes leaves no room for a part on {topic}")
    count = max(1, -(-len(data) // size))
    view = memoryview(data)
    return [HEADER.pack(MAGIC, msg_id, i, count) + view[i * size : (i + 1) * size]
            for i in range(count)]  # fmt: skip


def is_part(payload: bytes) -> bool:
    return payload[:4] == MAGIC


@dataclass
class _Message:
    count: int
    pieces: dict[int, bytes] = field(default_factory=dict)
    held: int = 0


class Joiner:
    """Joins parts into messages; touched by paho's network thread only.

    At most `max_pending` incomplete messages and `max_bytes` of their pieces are held
    (the oldest incomplete message goes first), a message may announce at most
    `max_parts` parts, and the last `remember` joined messages are remembered so that
    a part repeated after its message was joined is dropped, not held again.
    """

    def __init__(self, max_pending: int = 64, max_bytes: int = 128 << 20,
                 max_parts: int = 4096, remember: int = 256) -> None:  # fmt: skip
        self.max_pending, self.max_bytes, self.max_parts = max_pending, max_bytes, max_parts
        self._pending: OrderedDict[tuple[str, int], _Message] = OrderedDict()
        self._joined: deque[tuple[str, int]] = deque(maxlen=remember)
        self._held = 0
        self.abandoned = 0  # incomplete messages given up for the bounds

    def add(self, topic: str, payload: bytes) -> bytes | None:
        """The whole message once `payload` (a part) completes it; None until then."""
        if len(payload) < HEADER.size:
            raise PartError(f"part of {len(payload)} bytes on {topic} is shorter than its header")
        _magic, msg_id, index, count = HEADER.unpack_from(payload)
        if not 1 <= count <= self.max_parts or index >= count:
            raise PartError(f"part {index} of {count} on {topic}: the count must be in "
                            f"[1, {self.max_parts}] and the index below it")  # fmt: skip
        key = (topic, msg_id)
        if key in self._joined:
            return None  # a QoS 1 repeat of a message already delivered
        message = self._pending.get(key)
        if message is None:
            message = self._open(key, count)
        elif message.count != count:
            self._drop(key)
            raise PartError(f"part {index} on {topic} says {count} parts, its siblings "
                            f"{message.count}")  # fmt: skip
        if index not in message.pieces:
            piece = payload[HEADER.size :]
            message.pieces[index] = piece
            message.held += len(piece)
            self._held += len(piece)
        if len(message.pieces) < count:
            self._shed(keep=key)
            return None
        self._drop(key)
        self._joined.append(key)
        return b"".join(message.pieces[i] for i in range(count))

    def _open(self, key: tuple[str, int], count: int) -> _Message:
        if len(self._pending) >= self.max_pending:
            self._abandon(next(iter(self._pending)))
        message = self._pending[key] = _Message(count)
        return message

    def _drop(self, key: tuple[str, int]) -> None:
        self._held -= self._pending.pop(key).held

    def _abandon(self, key: tuple[str, int]) -> None:
        self._drop(key)
        self.abandoned += 1

    def _shed(self, keep: tuple[str, int]) -> None:
        """Abandon the oldest incomplete messages until the held bytes fit."""
        while self._held > self.max_bytes:
            oldest = next((k for k in self._pending if k != keep), keep)
            self._abandon(oldest)
            if oldest == keep:
                break

    @property
    def held_bytes(self) -> int:
        return self._held

    @property
    def pending(self) -> int:
        return len(self._pending)

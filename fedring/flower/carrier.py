"""fedring payloads inside Flower messages, as fedring frames.

A payload travels as the list of encoded fedring frames that `PeerChannel` would
hand to MQTT (compact header, body digest, or a sealed body when a key is set), stored
under one key of a Flower `ConfigRecord` (a list of bytes). The receiver decodes
them with the same bounded, checked path as every other transport, so a
malformed or oversized payload is a `FrameError`, never an allocation. Nothing
here imports `flwr`: a message is built from and read into plain values.

`message_bytes` (in `fedring.flower.metering`) counts what Flower itself moves.

    >>> import torch
    >>> from fedring.compression import GroupTopK
    >>> sent = GroupTopK(4, 1).compress(torch.tensor([1., -5, 2, 0]))
    >>> frames = pack(sent, src="node-0", dst="server", round=3, phase="up")
    >>> unpack(frames, src="node-0", dst="server", round=3, phase="up", numel=4).decompress()
    tensor([ 0., -5.,  0.,  0.])
"""

from __future__ import annotations

from collections import deque

from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.compression.payload import Payload, PayloadLimits
from fedring.transport.base import Deadline, Delivery, LinkStats, TransportTimeout

JOB = "flower"  # the frames' job id; Flower's run id scopes the messages themselves


class Mailbox:
    """A transport endpoint whose outbox and inbox are lists of encoded frames."""

    def __init__(self, name: str, peer: str) -> None:
        self.name = name
        self.stats = LinkStats()
        self.outbox: list[bytes] = []
        self.inbox: deque[Delivery] = deque()
        self._peer = peer

    def send(self, dst: str, data: bytes, deadline: Deadline) -> None:
        self.outbox.append(data)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(data)

    def recv(self, deadline: Deadline) -> Delivery:
        if not self.inbox:  # everything this message carried has been read
            raise TransportTimeout(f"{self.name}: no more frames in the message")
        item = self.inbox.popleft()
        self.stats.frames_received += 1
        self.stats.bytes_received += len(item.data)
        return item

    def peers(self) -> frozenset[str]:
        return frozenset({self._peer})

    def close(self) -> None:
        self.inbox.clear()


class CarrierError(ValueError):
    """The frames in a message do not hold the payload expected (the reason is named)."""


def pack(
    payload: Payload,
    *,
    src: str,
    dst: str,
    round: int,
    phase: str,
    step: int = 0,
    key: bytes | None = None,
) -> list[bytes]:
    """Encode `payload` as the frames `src` would send `dst` at (round, step, phase)."""
    box = Mailbox(src, dst)
    channel = PeerChannel(box, JOB, key=key)  # a Mailbox is an Endpoint
    channel.send(dst, payload, round=round, step=step, phase=phase, deadline=Deadline.after(1.0))
    return box.outbox


def unpack(
    frames: list[bytes],
    *,
    src: str,
    dst: str,
    round: int,
    phase: str,
    numel: int,
    step: int = 0,
    key: bytes | None = None,
) -> Payload:
    """Decode the payload `src` sent `dst` at (round, step, phase); no larger than `numel`."""
    box = Mailbox(dst, src)
    box.inbox.extend(Delivery(src, bytes(f)) for f in frames)
    channel = PeerChannel(box, JOB, key=key, payload_limits=PayloadLimits(max_numel=numel))
    try:
        payload = channel.recv(
            src, round=round, step=step, phase=phase, deadline=Deadline.after(0.0)
        )
    except CollectiveError as exc:
        refused = channel.counters.snapshot()
        raise CarrierError(
            f"{phase} payload from {src!r}, round {round}: {exc} {refused}"
        ) from None
    if payload.numel != numel:
        raise CarrierError(f"{phase} payload from {src!r} has numel {payload.numel}, not {numel}")
    return payload

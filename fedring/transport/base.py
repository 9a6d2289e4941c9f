"""The `Transport` protocol: named endpoints exchanging encoded frames.

In-process queues, an MQTT broker and a Flower relay all implement it, so the
ring, the agent and the coordinator never know which one carries their frames.
Every wait takes a `Deadline`; peers leaving or dying arrive as
`MembershipEvent`s in the same stream as frames, so a receiver waiting on a dead
neighbour wakes at once instead of at its deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol


@dataclass(frozen=True)
class Deadline:
    """An absolute point on the monotonic clock."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at


class TransportError(Exception):
    """Base of the transport's expected failures."""


class TransportTimeout(TransportError):
    """A wait reached its deadline."""


class PeerUnreachable(TransportError):
    """The destination is not (or no longer) connected."""


class EndpointClosed(TransportError):
    """This endpoint was closed or killed."""


@dataclass(frozen=True)
class Delivery:
    src: str
    data: bytes


@dataclass(frozen=True)
class MembershipEvent:
    """`joined`, `left` (said goodbye) or `lost` (died: last-will, missed heartbeat).

    `interrupted` is local: this endpoint's owner asked a blocked receive to give
    up (the coordinator halted the round).
    """

    kind: Literal["joined", "left", "lost", "interrupted"]
    name: str


@dataclass
class LinkStats:
    """Bytes and frames as they crossed this endpoint, encoding included."""

    frames_sent: int = 0
    bytes_sent: int = 0
    frames_received: int = 0
    bytes_received: int = 0
    per_peer_sent: dict[str, int] = field(default_factory=dict)


class Endpoint(Protocol):
    name: str
    stats: LinkStats

    def send(self, dst: str, data: bytes, deadline: Deadline) -> None:
        """Queue `data` for `dst`; raise `PeerUnreachable` or `TransportTimeout`."""
        ...

    def recv(self, deadline: Deadline) -> Delivery | MembershipEvent:
        """The next frame or membership event; raise `TransportTimeout` at the deadline."""
        ...

    def peers(self) -> frozenset[str]:
        """Names of the endpoints currently connected, this one excluded."""
        ...

    def close(self) -> None:
        """Leave cleanly: peers see a `left` event."""
        ...


class Broadcaster(Protocol):
    """An `Endpoint` that can reach every member of its job with one send.

    Over MQTT that is one publish on the job's broadcast topic (the broker fans it
    out); in-process one copy into every other inbox. Either way it costs the
    sender's uplink once and each receiver's downlink once. Frames sent this way
    carry the destination ``BROADCAST`` ("*"), which every receiver accepts.
    """

    def broadcast(self, data: bytes, deadline: Deadline) -> None:
        """Queue `data` for every other endpoint of the job; raise `TransportTimeout`."""
        ...


BROADCAST = "*"  # the frame destination of a broadcast: every member accepts it


class Transport(Protocol):
    def connect(self, name: str) -> Endpoint: ...

"""In-process transport: real encoded frames between named endpoints, on threads.

The embedded default for `fedring simulate` and the unit tests. It carries the
same bytes as the MQTT transport, so every decoder, limit and hash check runs.
`kill(name)` makes an endpoint vanish without a goodbye, as `kill -9` would, so
tests can exercise lost-peer handling.
"""

from __future__ import annotations

import contextlib
import queue
import threading

from fedring.transport.base import (
    Deadline,
    Delivery,
    EndpointClosed,
    LinkStats,
    MembershipEvent,
    PeerUnreachable,
    TransportTimeout,
)

_CLOSED = object()


class InprocEndpoint:
    """One named endpoint of an `InprocTransport`."""

    def __init__(self, hub: InprocTransport, name: str, max_queue: int) -> None:
        self.name = name
        self.stats = LinkStats()
        self._hub = hub
        self._inbox: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._closed = False

    def send(self, dst: str, data: bytes, deadline: Deadline) -> None:
        if self._closed:
            raise EndpointClosed(f"endpoint {self.name!r} is closed")
        target = self._hub._lookup(dst)
        try:
            target._inbox.put(Delivery(self.name, data), timeout=deadline.remaining())
        except queue.Full as exc:
            raise TransportTimeout(f"inbox of {dst!r} stayed full until the deadline") from exc
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(data)
        self.stats.per_peer_sent[dst] = self.stats.per_peer_sent.get(dst, 0) + len(data)

    def recv(self, deadline: Deadline) -> Delivery | MembershipEvent:
        if self._closed:
            raise EndpointClosed(f"endpoint {self.name!r} is closed")
        try:
            item = self._inbox.get(timeout=deadline.remaining())
        except queue.Empty as exc:
            raise TransportTimeout(f"{self.name!r} received nothing before the deadline") from exc
        if item is _CLOSED:
            raise EndpointClosed(f"endpoint {self.name!r} was killed")
        if isinstance(item, Delivery):
            self.stats.frames_received += 1
            self.stats.bytes_received += len(item.data)
        return item  # type: ignore[return-value]

    def peers(self) -> frozenset[str]:
        return self._hub.names() - {self.name}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._hub._remove(self.name, "left")

    def _event(self, event: MembershipEvent) -> None:
        # A flooded inbox still learns of the change from peers().
        with contextlib.suppress(queue.Full):
            self._inbox.put_nowait(event)


class InprocTransport:
    """A hub of endpoints inside one process."""

    def __init__(self, max_queue: int = 4096) -> None:
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._endpoints: dict[str, InprocEndpoint] = {}

    def connect(self, name: str) -> InprocEndpoint:
        if not name or "/" in name or "+" in name or "#" in name:
            raise ValueError(f"endpoint name {name!r} must be non-empty without '/', '+' or '#'")
        with self._lock:
            if name in self._endpoints:
                raise ValueError(f"endpoint {name!r} is already connected")
            endpoint = InprocEndpoint(self, name, self.max_queue)
            others = list(self._endpoints.values())
            self._endpoints[name] = endpoint
        for other in others:
            other._event(MembershipEvent("joined", name))
        return endpoint

    def kill(self, name: str) -> None:
        """Make `name` vanish abruptly: peers see `lost`; its own calls fail."""
        with self._lock:
            endpoint = self._endpoints.get(name)
        if endpoint is None:
            raise ValueError(f"no endpoint {name!r} to kill")
        endpoint._closed = True
        self._remove(name, "lost")
        endpoint._inbox.put(_CLOSED)  # wake a receiver blocked in recv()

    def names(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._endpoints)

    def _lookup(self, name: str) -> InprocEndpoint:
        with self._lock:
            endpoint = self._endpoints.get(name)
        if endpoint is None:
            raise PeerUnreachable(f"no endpoint {name!r} is connected")
        return endpoint

    def _remove(self, name: str, kind: str) -> None:
        with self._lock:
            self._endpoints.pop(name, None)
            others = list(self._endpoints.values())
        for other in others:
            other._event(MembershipEvent(kind, name))  # type: ignore[arg-type]

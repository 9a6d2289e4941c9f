"""In-process transport: real encoded frames between named endpoints, on threads.

The embedded default for `fedring simulate` and the unit tests. It carries the
same bytes as the MQTT transport, so every decoder, limit and hash check runs.
`kill(name)` makes an endpoint vanish without a goodbye, as `kill -9` would, so
tests can exercise lost-peer handling.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator

from fedring.transport.base import (
    BROADCAST,
    Deadline,
    Delivery,
    EndpointClosed,
    LinkStats,
    MembershipEvent,
    PeerUnreachable,
    TransportTimeout,
)


class Baton:
    """Lets one participating thread run at a time; it is passed on only by waiting.

    With many agent threads on few cores, Python threads that all want the GIL
    thrash: every short torch call releases it and the caller queues to get it
    back. Simulated agents spend most of their time waiting for a neighbour, so
    running exactly one at a time, handing over only when it blocks on an empty
    inbox, does the same work without the convoy (measured: 32 agents, ~5x faster).
    Threads outside `turn()` are unaffected.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mine = threading.local()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Run the body as a participant: it holds the baton except while waiting."""
        self._lock.acquire()
        self._mine.held = True
        try:
            yield
        finally:
            self._mine.held = False
            self._lock.release()

    def wait(self, cond: threading.Condition, timeout: float) -> bool:
        """`cond.wait(timeout)` that lets another participant run meanwhile."""
        if not getattr(self._mine, "held", False):
            return cond.wait(timeout)
        self._mine.held = False
        self._lock.release()
        woke = cond.wait(timeout)
        cond.release()  # never block on the baton while holding an inbox lock
        try:
            self._lock.acquire()
            self._mine.held = True
        finally:
            cond.acquire()
        return woke


class _Inbox:
    """FIFO of frames and events; only frames count against `max_frames`.

    Membership events are never refused: a flooded receiver must still learn
    that a peer died, in order with the frames that peer sent before it did.
    """

    def __init__(self, max_frames: int, baton: Baton | None = None) -> None:
        self.max_frames = max_frames
        self._items: deque[Delivery | MembershipEvent] = deque()
        self._frames = 0
        self._closed = False
        self._cond = threading.Condition()
        self._baton = baton

    def _wait(self, deadline: Deadline) -> bool:
        if self._baton is None:
            return self._cond.wait(deadline.remaining())
        return self._baton.wait(self._cond, deadline.remaining())

    def put_frame(self, item: Delivery, deadline: Deadline) -> bool:
        with self._cond:
            while self._frames >= self.max_frames and not self._closed:
                if not self._wait(deadline) and deadline.expired:
                    return False
            self._items.append(item)
            self._frames += 1
            self._cond.notify_all()
            return True

    def put_event(self, event: MembershipEvent) -> None:
        with self._cond:
            self._items.append(event)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def get(self, deadline: Deadline) -> Delivery | MembershipEvent | None:
        """The next item; None when closed; raise `TransportTimeout` at the deadline."""
        with self._cond:
            while not self._items and not self._closed:
                if not self._wait(deadline) and deadline.expired and not self._items:
                    raise TransportTimeout("nothing arrived before the deadline")
            if self._closed:
                return None
            item = self._items.popleft()
            if isinstance(item, Delivery):
                self._frames -= 1
                self._cond.notify_all()
            return item


class InprocEndpoint:
    """One named endpoint of an `InprocTransport`."""

    def __init__(self, hub: InprocTransport, name: str, max_queue: int) -> None:
        self.name = name
        self.stats = LinkStats()
        self._hub = hub
        self._inbox = _Inbox(max_queue, hub.baton)
        self._closed = False

    def send(self, dst: str, data: bytes, deadline: Deadline) -> None:
        """Queue `data` for `dst`, waiting for room until `deadline`."""
        if self._closed:
            raise EndpointClosed(f"endpoint {self.name!r} is closed")
        target = self._hub._lookup(dst)
        if not target._inbox.put_frame(Delivery(self.name, data), deadline):
            raise TransportTimeout(f"inbox of {dst!r} stayed full until the deadline")
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(data)
        self.stats.per_peer_sent[dst] = self.stats.per_peer_sent.get(dst, 0) + len(data)

    def broadcast(self, data: bytes, deadline: Deadline) -> None:
        """Queue `data` for every other endpoint on the hub (one send on our uplink,
        one receive on each of theirs, as a broker's fan-out costs)."""
        if self._closed:
            raise EndpointClosed(f"endpoint {self.name!r} is closed")
        item = Delivery(self.name, data)
        for target in self._hub._others(self.name):
            if not target._inbox.put_frame(item, deadline):
                raise TransportTimeout(f"inbox of {target.name!r} stayed full until the deadline")
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(data)
        self.stats.per_peer_sent[BROADCAST] = self.stats.per_peer_sent.get(BROADCAST, 0) + len(data)

    def recv(self, deadline: Deadline) -> Delivery | MembershipEvent:
        """The next frame or membership event, in arrival order."""
        if self._closed:
            raise EndpointClosed(f"endpoint {self.name!r} is closed")
        try:
            item = self._inbox.get(deadline)
        except TransportTimeout as exc:
            raise TransportTimeout(f"{self.name!r} received nothing before the deadline") from exc
        if item is None:
            raise EndpointClosed(f"endpoint {self.name!r} was closed or killed")
        if isinstance(item, Delivery):
            self.stats.frames_received += 1
            self.stats.bytes_received += len(item.data)
        return item

    def peers(self) -> frozenset[str]:
        return self._hub.names() - {self.name}

    def close(self) -> None:
        """Leave: peers see a `left` event; a blocked `recv` here wakes and raises."""
        if not self._closed:
            self._closed = True
            self._hub._remove(self, "left")
            self._inbox.close()

    def _event(self, event: MembershipEvent) -> None:
        self._inbox.put_event(event)


class InprocTransport:
    """A hub of endpoints inside one process."""

    def __init__(self, max_queue: int = 4096, cooperative: bool = False) -> None:
        self.max_queue = max_queue
        # With `cooperative`, threads that run inside `baton.turn()` take turns.
        self.baton: Baton | None = Baton() if cooperative else None
        self._lock = threading.Lock()
        self._endpoints: dict[str, InprocEndpoint] = {}

    def connect(self, name: str) -> InprocEndpoint:
        """A new endpoint called `name`; the others see a `joined` event."""
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
        self._remove(endpoint, "lost")
        endpoint._inbox.close()  # wakes a receiver blocked in recv(), never blocks

    def names(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._endpoints)

    def _others(self, name: str) -> list[InprocEndpoint]:
        with self._lock:
            return [e for n, e in self._endpoints.items() if n != name]

    def _lookup(self, name: str) -> InprocEndpoint:
        with self._lock:
            endpoint = self._endpoints.get(name)
        if endpoint is None:
            raise PeerUnreachable(f"no endpoint {name!r} is connected")
        return endpoint

    def _remove(self, endpoint: InprocEndpoint, kind: str) -> None:
        with self._lock:
            if self._endpoints.get(endpoint.name) is not endpoint:
                return  # already gone, or the name now belongs to a newer endpoint
            del self._endpoints[endpoint.name]
            others = list(self._endpoints.values())
        for other in others:
            other._event(MembershipEvent(kind, endpoint.name))  # type: ignore[arg-type]

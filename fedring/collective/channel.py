"""Payloads to frames and back, between this endpoint and one named peer at a time.

`PeerChannel.send` packs a payload into a body, splits it into compact frames
(`fedring.wire.compact`: a header of at most 64 B) below the frame limit, seals
them with the job key (`fedring.wire.seal`), and hands them to the transport.
`PeerChannel.recv` waits (with a deadline) for the payload a peer sent for one
position in the schedule (round, step, phase). On the way it refuses and counts
everything else: malformed frames, bad hashes or seals, frames for another job,
repeats of a (src, seq) already seen. Payloads for a later position are kept, as
checked bytes, until asked for; they are decoded then, with the caller's limits.
A refused frame never ends the wait: a good copy may still come; if
none does, the timeout names the last refusal.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any

from fedring.collective.payloads import decode_payload, encode_payload
from fedring.compression.payload import Payload, PayloadLimits
from fedring.counters import Counters
from fedring.logs_limit import LogLimiter
from fedring.transport.base import (
    BROADCAST,
    Broadcaster,
    Deadline,
    Endpoint,
    MembershipEvent,
    PeerUnreachable,
    TransportTimeout,
)
from fedring.wire.chunks import Reassembler, SeenWindow, split_payload
from fedring.wire.compact import decode_compact, encode_compact
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame, FrameLimits

log = logging.getLogger(__name__)

Position = tuple[str, int, int, str]  # (src, round, step, phase)


class CollectiveError(Exception):
    """A collective could not complete: a peer died or went silent."""


class PeerLost(CollectiveError):
    def __init__(self, peer: str) -> None:
        super().__init__(f"peer {peer!r} left or was lost")
        self.peer = peer


class CollectiveTimeout(CollectiveError):
    pass


class CollectiveInterrupted(CollectiveError):
    """This endpoint's owner interrupted the wait (the round was halted)."""


class PeerChannel:
    """Sends payloads as frames and receives them from peers, for one job."""

    def __init__(
        self,
        endpoint: Endpoint,
        job: str,
        key: bytes | None = None,
        limits: FrameLimits | None = None,
        payload_limits: PayloadLimits | None = None,
        counters: Counters | None = None,
        max_stash: int = 256,
    ) -> None:
        self.endpoint = endpoint
        self.job = job
        self.key = key
        self.limits = limits or FrameLimits()
        self.payload_limits = payload_limits or PayloadLimits()
        self.counters = counters or Counters()
        self.payload_bytes_sent = 0
        self._seq = itertools.count()
        self._seen = SeenWindow()
        self._parts = Reassembler(self.limits)
        self._stash: OrderedDict[Position, tuple[Mapping[str, Any], bytearray]] = OrderedDict()
        self._max_stash = max_stash
        self._last_refusal = ""
        self._log = LogLimiter(log, f"refusals at {self.name}")

    @property
    def name(self) -> str:
        return self.endpoint.name

    def send(
        self, dst: str, payload: Payload, *, round: int, step: int, phase: str, deadline: Deadline
    ) -> None:
        """Send `payload` to `dst` as one or more (sealed, with a key) frames."""
        for data in self._frames(dst, payload, round=round, step=step, phase=phase):
            try:
                self.endpoint.send(dst, data, deadline)
            except PeerUnreachable as exc:
                self.counters.add("peer_lost")
                raise PeerLost(dst) from exc
            except TransportTimeout as exc:
                self.counters.add("timeout")
                raise CollectiveTimeout(f"{self.name!r} could not hand a frame to {dst!r}") from exc

    def broadcast(
        self, payload: Payload, members: Collection[str], *, round: int, step: int, phase: str,
        deadline: Deadline,
    ) -> None:  # fmt: skip
        """Send `payload` to every other member of `members` at once.

        On a `Broadcaster` endpoint that is one send of frames addressed to
        ``BROADCAST``, whatever the number of members; on any other endpoint, one
        `send` to each of them.
        """
        if not callable(getattr(self.endpoint, "broadcast", None)):
            for dst in members:
                if dst != self.name:
                    self.send(dst, payload, round=round, step=step, phase=phase, deadline=deadline)
            return
        caster: Broadcaster = self.endpoint  # type: ignore[assignment]
        for data in self._frames(BROADCAST, payload, round=round, step=step, phase=phase):
            try:
                caster.broadcast(data, deadline)
            except TransportTimeout as exc:
                self.counters.add("timeout")
                raise CollectiveTimeout(f"{self.name!r} could not broadcast a frame") from exc

    def _frames(
        self, dst: str, payload: Payload, *, round: int, step: int, phase: str
    ) -> list[bytes]:
        """`payload` as encoded (sealed) compact frames for `dst`, each below the limit."""
        meta, body = encode_payload(payload)
        template = Frame(
            kind="chunk", job=self.job, src=self.name, dst=dst, seq=0,
            round=round, step=step, phase=phase, meta=meta,
        )  # fmt: skip
        frames = split_payload(template, body, next(self._seq), self.limits)
        for _ in frames[1:]:
            next(self._seq)
        out = []
        for frame in frames:
            data = encode_compact(frame, self.key)
            if len(data) > self.limits.max_frame_bytes:  # a header too big: our bug, not theirs
                raise ValueError(f"encoded frame of {len(data)} bytes > max_frame_bytes")
            out.append(data)
        self.payload_bytes_sent += len(body)
        return out

    def recv(
        self,
        src: str,
        *,
        round: int,
        step: int,
        phase: str,
        deadline: Deadline,
        accept: Callable[[Payload], None] | None = None,
        limits: PayloadLimits | None = None,
    ) -> Payload:
        """The payload `src` sent for (round, step, phase).

        The payload is decoded with `limits` (default: the channel's), so a
        receiver that knows the expected size refuses larger claims before any
        allocation; `accept` may refuse it after decoding by raising `FrameError`.
        """
        want: Position = (src, round, step, phase)
        while True:
            stashed = self._stash.pop(want, None)
            if stashed is not None:
                try:
                    payload = decode_payload(stashed[0], stashed[1], limits or self.payload_limits)
                    if accept is not None:
                        accept(payload)
                    return payload
                except FrameError as exc:
                    self._refuse(src, exc)
            self._pull(deadline, (src,), f"{phase} step {step} of round {round} from {src!r}")

    def gather(
        self,
        srcs: Collection[str],
        *,
        round: int,
        step: int,
        phase: str,
        deadline: Deadline,
        accept: Callable[[Payload], None] | None = None,
        limits: PayloadLimits | None = None,
    ) -> dict[str, Payload]:
        """The payload each of `srcs` sent for (round, step, phase), in whatever order
        they arrive; a member of `srcs` not yet heard from that is lost ends the wait
        with `PeerLost` (`recv` one at a time would notice only the one it waits on)."""
        want, got = set(srcs), {}
        while want:
            for src in sorted(want):
                stashed = self._stash.pop((src, round, step, phase), None)
                if stashed is None:
                    continue
                try:
                    payload = decode_payload(stashed[0], stashed[1], limits or self.payload_limits)
                    if accept is not None:
                        accept(payload)
                except FrameError as exc:
                    self._refuse(src, exc)
                    continue
                got[src] = payload
                want.discard(src)
            if want:
                self._pull(deadline, tuple(sorted(want)),
                           f"{phase} step {step} of round {round} from {sorted(want)}")  # fmt: skip
        return got

    def recv_any(
        self,
        srcs: Collection[str],
        *,
        phases: Collection[str],
        deadline: Deadline,
        limits: PayloadLimits | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> tuple[Position, Payload]:
        """The oldest payload any of `srcs` sent in one of `phases`, whatever its round
        and step, with its position: an asynchronous centre takes updates in the order
        they come. A member of `srcs` lost meanwhile goes to `on_lost` (default: the
        wait ends with `PeerLost`)."""
        while True:
            for pos in [p for p in self._stash if p[0] in srcs and p[3] in phases]:
                meta, body = self._stash.pop(pos)
                try:
                    return pos, decode_payload(meta, body, limits or self.payload_limits)
                except FrameError as exc:
                    self._refuse(pos[0], exc)
            self._pull(deadline, tuple(srcs), f"{'/'.join(phases)} from any of {sorted(srcs)}",
                       on_lost)  # fmt: skip

    def _pull(
        self, deadline: Deadline, srcs: tuple[str, ...], what: str,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        """Take one item from the endpoint: a frame into the stash, or a membership
        event acted on (an interruption or a lost `srcs` member ends the wait)."""
        try:
            item = self.endpoint.recv(deadline)
        except TransportTimeout as exc:
            gone = [s for s in srcs if s not in self.endpoint.peers()]
            if gone and len(gone) == len(srcs):  # a goodbye may have been lost
                self.counters.add("peer_lost")
                raise PeerLost(gone[0]) from exc
            self.counters.add("timeout")
            last = f"; last refused frame: {self._last_refusal}" if self._last_refusal else ""
            raise CollectiveTimeout(f"{self.name!r} waited for {what}{last}") from exc
        if isinstance(item, MembershipEvent):
            if item.kind == "interrupted":
                if item.name in (self.job, "*"):
                    raise CollectiveInterrupted(f"{self.name!r}: waiting for {what}: interrupted")
                return  # meant for an earlier job or epoch
            if item.kind == "joined":
                self._seen.forget(item.name)  # a restarted peer counts from 0 again
            elif item.name in srcs and (item.name not in self.endpoint.peers()
                                        or self._seen.heard(item.name)):  # fmt: skip
                # (the loss of a peer that is online again and that this channel never
                # heard from was queued before it began, during an earlier job: stale)
                self.counters.add("peer_lost")
                if on_lost is None:
                    raise PeerLost(item.name)
                on_lost(item.name)
            return
        self._take(item.src, item.data)

    def _take(self, sender: str, data: bytes) -> None:
        """Check one delivery and stash its payload bytes, or refuse and count it."""
        try:
            if not sender:  # the compact frame's tag binds the sender's name, so it must be known
                raise FrameError(FrameReason.UNEXPECTED, "the transport did not name the sender")
            frame = decode_compact(data, job=self.job, src=sender, dsts=(self.name, BROADCAST),
                                   key=self.key, limits=self.limits)  # fmt: skip
            if not self._seen.first_time(frame.src, frame.seq):
                self.counters.add("duplicate")
                return
            done = self._parts.add(frame)
        except FrameError as exc:
            self._refuse(sender, exc)
            return
        if done is None:
            return
        head, body = done
        if len(self._stash) >= self._max_stash:
            (src, rnd, step, phase), _ = self._stash.popitem(last=False)
            self.counters.add("stash_evicted")
            self._log.warning(src, "stash_evicted", "%s dropped an early payload from %s "
                              "(round %d, step %d, %s): its stash holds at most %d",
                              self.name, src, rnd, step, phase, self._max_stash)  # fmt: skip
        self._stash[(head.src, head.round, head.step, head.phase)] = (head.meta, body)

    def _refuse(self, sender: str, exc: FrameError) -> None:
        self.counters.add(f"frame_{exc.reason.value}")
        self._last_refusal = f"{exc} (from {sender!r})"
        self._log.warning(sender, exc.reason.value, "%s refused a frame from %s: %s",
                          self.name, sender, exc)  # fmt: skip

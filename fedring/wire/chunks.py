"""Payloads larger than one frame: split into parts, reassemble, de-duplicate.

A sender cuts a payload into bodies of at most `FrameLimits.max_body_bytes`; when
it takes more than one, every part carries the same `meta` plus `msg` (the message
id: the seq of part 0) and `payload_sha256`. A one-part payload needs neither: the
frame's own sha256 covers it. The receiver collects parts per (src, msg), refuses anything
inconsistent, and checks the digest of the joined payload. MQTT QoS 1 delivers at
least once, so receivers also drop repeats by (src, seq).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame, FrameLimits
from fedring.wire.integrity import sha256


def split_payload(
    template: Frame, payload: bytes, first_seq: int, limits: FrameLimits
) -> list[Frame]:
    """Frames for `payload`, numbered from `first_seq`; `template` gives the header."""
    size = limits.max_body_bytes
    n = max(1, math.ceil(len(payload) / size))
    if n > limits.max_parts:
        raise ValueError(f"payload of {len(payload)} bytes needs {n} parts > {limits.max_parts}")
    if n == 1:  # the frame's own sha256 covers the whole payload
        return [template.replace(seq=first_seq, part=(0, 1), body=bytes(payload))]
    meta = dict(template.meta)
    meta["msg"] = first_seq
    meta["payload_sha256"] = sha256(payload)
    view = memoryview(payload)
    return [
        template.replace(
            seq=first_seq + i, part=(i, n), meta=meta, body=bytes(view[i * size : (i + 1) * size])
        )
        for i in range(n)
    ]


@dataclass
class _Pending:
    n: int
    digest: bytes
    header: tuple[Any, ...]
    parts: dict[int, bytes] = field(default_factory=dict)


class Reassembler:
    """Collects parts into payloads; bounded in pending messages and bytes.

    A payload may not announce more parts than `max_payload_bytes` needs, and the
    bytes held for incomplete payloads stay below `max_pending_bytes`: the oldest
    incomplete payloads are abandoned first.
    """

    def __init__(
        self,
        limits: FrameLimits | None = None,
        max_pending: int = 64,
        max_payload_bytes: int = 64 << 20,
        max_pending_bytes: int = 128 << 20,
    ) -> None:
        self.limits = limits or FrameLimits()
        self.max_pending = max_pending
        self.max_parts = min(
            self.limits.max_parts, -(-max_payload_bytes // self.limits.max_body_bytes)
        )
        self.max_pending_bytes = max_pending_bytes
        self._pending: OrderedDict[tuple[str, int], _Pending] = OrderedDict()
        self._held = 0  # bytes of parts held for incomplete payloads

    def add(self, frame: Frame) -> tuple[Frame, bytearray] | None:
        """Return ``(first_part, payload)`` once `frame` completes a message."""
        i, n = frame.part
        msg = frame.meta.get("msg", frame.seq)
        digest = frame.meta.get("payload_sha256")
        # 32 bytes in a version-1 frame, 8 in a compact one (see `fedring.wire.compact`)
        if type(msg) is not int or not isinstance(digest, bytes) or len(digest) not in (8, 32):
            if n == 1 and "payload_sha256" not in frame.meta:
                return frame, bytearray(frame.body)
            raise FrameError(FrameReason.BAD_PART, f"part {i}/{n} lacks msg or payload_sha256")
        if frame.seq != msg + i:
            raise FrameError(FrameReason.BAD_PART, f"part {i} has seq {frame.seq}, msg {msg}")
        if n > self.max_parts:
            raise FrameError(FrameReason.OVERSIZE, f"payload of {n} parts > {self.max_parts}")
        key = (frame.src, msg)
        header = (frame.kind, frame.job, frame.round, frame.step, frame.phase, frame.dst)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._open(key, n, digest, header)
        if (pending.n, pending.digest, pending.header) != (n, digest, header):
            self._drop(key)
            raise FrameError(FrameReason.BAD_PART, f"part {i}/{n} disagrees with its siblings")
        if len(frame.body) > self.limits.max_body_bytes:
            raise FrameError(FrameReason.OVERSIZE, f"part body of {len(frame.body)} bytes")
        self._held += len(frame.body) - len(pending.parts.get(i, b""))
        pending.parts[i] = frame.body
        if len(pending.parts) < n:
            self._shed(keep=key)
            return None
        self._drop(key)
        payload = bytearray().join(pending.parts[j] for j in range(n))
        if sha256(payload)[: len(digest)] != digest:
            raise FrameError(FrameReason.BAD_SHA256, f"payload msg={msg} from {frame.src!r}")
        return frame.replace(part=(0, n), seq=msg), payload

    def _open(
        self, key: tuple[str, int], n: int, digest: bytes, header: tuple[Any, ...]
    ) -> _Pending:
        if len(self._pending) >= self.max_pending:
            self._drop(next(iter(self._pending)))  # oldest incomplete message is abandoned
        pending = _Pending(n=n, digest=digest, header=header)
        self._pending[key] = pending
        return pending

    def _drop(self, key: tuple[str, int]) -> None:
        pending = self._pending.pop(key)
        self._held -= sum(len(b) for b in pending.parts.values())

    def _shed(self, keep: tuple[str, int]) -> None:
        """Abandon the oldest incomplete payloads until the held bytes fit."""
        while self._held > self.max_pending_bytes:
            oldest = next(k for k in self._pending if k != keep) if len(self._pending) > 1 else keep
            self._drop(oldest)
            if oldest == keep:
                break

    @property
    def held_bytes(self) -> int:
        return self._held

    def pending(self) -> Iterator[tuple[str, int]]:
        return iter(list(self._pending))


class SeenWindow:
    """Remembers recent (src, seq) pairs to drop at-least-once redeliveries."""

    def __init__(self, window: int = 4096) -> None:
        self.window = window
        self._seen: dict[str, set[int]] = {}
        self._high: dict[str, int] = {}

    def forget(self, src: str) -> None:
        """Start afresh for `src` (it restarted and counts from 0 again)."""
        self._seen.pop(src, None)
        self._high.pop(src, None)

    def heard(self, src: str) -> bool:
        """True once a frame of `src` was taken (since it last restarted)."""
        return src in self._high

    def first_time(self, src: str, seq: int) -> bool:
        """True the first time (src, seq) is seen; False for a repeat or a too-old seq."""
        high = self._high.get(src, -1)
        seen = self._seen.setdefault(src, set())
        if seq in seen or seq <= high - self.window:
            return False
        seen.add(seq)
        if seq > high:
            self._high[src] = seq
            floor = seq - self.window
            if len(seen) > 2 * self.window:
                self._seen[src] = {s for s in seen if s > floor}
        return True

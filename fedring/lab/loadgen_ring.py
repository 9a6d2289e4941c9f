"""A protocol agent's part of a ring job: the ring's chunk frames, sent and checked.

A real member all-reduces each round's gradient with its ring neighbours
(`collective.ring.Ring.allreduce_sparse`, policy ``bounded``): N-1 reduce-scatter
steps (phase ``rs``), then N-1 all-gather steps (``ag``). In step s it sends one
chunk to its right neighbour and waits for its left neighbour's chunk of that step
before the next one, so a round is 2(N-1) hops in a row whatever the link's speed.
Each chunk is groups ``chunk_bounds(G, N)[c]`` of a group-top-k payload, k entries
a group (`loadgen_payloads.sparse_chunk`), sent as sealed compact frames
(`wire.compact`) on ``jobs/{job}/to/{right}/{me}``, the frame's job ``{job}.e{epoch}``,
tagged with the round, the step and the phase: bytes for bytes what a daemon sends.

`RingPeer` does the same with opaque chunks: it sends each step's frames, and takes
the left neighbour's, checked as a `PeerChannel` checks them (seal, route,
repeats, parts) and then against the step: the chunk's groups, its ``numel`` and
its body's size. A frame that fails is counted (`RingStats.refused`) and logged,
never raised; frames arriving before the model's size is known are held, a bounded
number. Nothing is summed: values are zero and every member's parameters are
`Params`' anyway.

    >>> RingPeer.plan(rank=1, world=4, step=0, phase="rs")
    (1, 0)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fedring.lab.loadgen_payloads import chunk_bounds, sparse_chunk
from fedring.wire.chunks import Reassembler, SeenWindow, split_payload
from fedring.wire.compact import decode_compact, encode_compact
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame, FrameLimits

log = logging.getLogger(__name__)
PHASES = ("rs", "ag")  # reduce-scatter, all-gather (`collective.ring.tagged`, no buckets)
EARLY_MAX = 64  # frames held before the model's size is known

Publish = Callable[[str, bytes], None]  # (dst, frame): onto dst's inbox topic


@dataclass
class RingStats:
    frames_sent: int = 0
    bytes_sent: int = 0  # encoded frames, as `MqttEndpoint.stats.bytes_sent`
    body_bytes_sent: int = 0  # payload bodies, as `PeerChannel.payload_bytes_sent`
    frames_received: int = 0
    body_bytes_received: int = 0
    refused: int = 0
    duplicates: int = 0
    steps: int = 0  # exchanges completed
    step_bodies: list[int] = field(default_factory=list)  # the first round's, step by step


@dataclass(frozen=True)
class RingShape:
    """What a segment's ring is: this member's place, its neighbours, the codec."""

    job: str  # the frames' job: ``{job}.e{epoch}``
    me: str
    rank: int
    world: int
    left: str
    right: str
    numel: int
    group_size: int
    k: int
    value_dtype: str

    @classmethod
    def from_manifest(cls, me: str, channel_job: str, doc: dict[str, Any], numel: int,
                      k: int) -> RingShape:  # fmt: skip
        """The ring of a manifest (a `ValueError` names what a flat ring cannot be)."""
        rank, world, peers = int(doc["rank"]), int(doc["world"]), doc.get("peers")
        if not isinstance(peers, dict) or not 0 <= rank < world:
            raise ValueError(f"manifest: rank={rank!r} of world={world!r}, peers={peers!r}")
        near = {int(p) for p in peers} - {rank, (rank - 1) % world, (rank + 1) % world}
        if near:  # a torus, a fanout or a hub: members beyond the flat ring's neighbours
            raise ValueError(f"manifest peers {sorted(near)} beyond a flat ring's neighbours")
        spec = doc["spec"]
        replayed = {
            "compression": "group-topk",
            "policy": "bounded",
            "density_warmup": 0,
            "density_flush": 0,
            "bucket_kb": 0,
            "update_delay": 0,
            "pipeline_stages": 1,
        }
        for name, value in replayed.items():  # else a real member's chunks are not these
            if spec.get(name, value) != value:
                raise ValueError(f"job field {name}={spec[name]!r}: the load generator's "
                                 f"rings replay {name}={value!r} only")  # fmt: skip
        if doc.get("collective", "ring") != "ring" or doc.get("codec", ""):
            raise ValueError(
                f"manifest collective={doc.get('collective')!r}, codec="
                f"{doc.get('codec')!r}: the load generator replays a sparse ring"
            )
        return cls(channel_job, me, rank, world, str(peers[str((rank - 1) % world)]),
                   str(peers[str((rank + 1) % world)]), numel, int(spec.get("group_size", 256)),
                   k, str(spec.get("value_dtype", "fp16")))  # fmt: skip


class RingPeer:
    """One member's ring: each step's frames out to the right, the left's checked in."""

    def __init__(self, shape: RingShape, key: bytes, limits: FrameLimits) -> None:
        self.shape, self.key, self.limits = shape, key, limits
        self.stats = RingStats()
        self.round = 0  # the round under way: frames of it and the next one are taken
        self._seq = 0
        self._seen = SeenWindow()
        self._parts = Reassembler(limits)
        self._early: list[tuple[str, bytes]] = []  # before `numel` is known
        self._arrived: dict[tuple[int, int, str], int] = {}  # position -> body bytes
        self._wake = asyncio.Event()
        self._chunks: dict[tuple[int, int], tuple[dict[str, Any], bytes]] = {}

    @staticmethod
    def plan(rank: int, world: int, step: int, phase: str) -> tuple[int, int]:
        """(chunk sent, chunk received) at `step` of `phase` (`Ring.reduce_scatter`,
        `Ring.all_gather`: the gather sends what it received the step before)."""
        if phase == "rs":
            return (rank - step) % world, (rank - step - 1) % world
        return (rank - step + 1) % world, (rank - step) % world

    def _bounds(self) -> list[tuple[int, int]]:
        s = self.shape
        return chunk_bounds(-(-s.numel // s.group_size), s.world)

    def _chunk(self, span: tuple[int, int]) -> tuple[dict[str, Any], bytes]:
        if span not in self._chunks:  # the same span every round: packed once
            s = self.shape
            self._chunks[span] = sparse_chunk(s.numel, s.group_size, s.k, s.value_dtype, span)
        return self._chunks[span]

    def set_numel(self, numel: int) -> None:
        """The model's size is known now: take the frames held until then."""
        if self.shape.numel == numel:
            return
        self.shape = replace(self.shape, numel=numel)
        early, self._early = self._early, []
        for src, data in early:
            self.take(src, data)

    # -- sending ------------------------------------------------------------------------

    def frames(self, round: int, step: int, phase: str) -> list[bytes]:
        """This member's sealed frames for one step, to its right neighbour."""
        s = self.shape
        sent, _ = self.plan(s.rank, s.world, step, phase)
        meta, body = self._chunk(self._bounds()[sent])
        template = Frame(kind="chunk", job=s.job, src=s.me, dst=s.right, seq=0, round=round,
                         step=step, phase=phase, meta=meta)  # fmt: skip
        frames = split_payload(template, body, self._seq, self.limits)
        self._seq += len(frames)
        self.stats.body_bytes_sent += len(body)
        if self.stats.steps < 2 * (s.world - 1):
            self.stats.step_bodies.append(len(body))
        return [encode_compact(f, self.key) for f in frames]

    async def run_round(self, publish: Publish, round: int, timeout_s: float) -> float:
        """All 2(N-1) steps of `round`; the seconds they took (the row's ``comm_s``)."""
        self.round = round
        start = time.monotonic()
        for phase in PHASES:
            for step in range(self.shape.world - 1):
                for data in self.frames(round, step, phase):
                    publish(self.shape.right, data)
                    self.stats.frames_sent += 1
                    self.stats.bytes_sent += len(data)
                await self._wait((round, step, phase), time.monotonic() + timeout_s)
                self.stats.steps += 1
        return time.monotonic() - start

    async def _wait(self, pos: tuple[int, int, str], deadline: float) -> None:
        while pos not in self._arrived:
            self._wake.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.shape.me}: {pos[2]} step {pos[1]} of round {pos[0]} "
                                   f"from {self.shape.left!r} never came")  # fmt: skip
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                continue
        del self._arrived[pos]

    # -- receiving ----------------------------------------------------------------------

    def take(self, src: str, data: bytes) -> None:
        """One delivery on our inbox from `src`: checked, and its step marked arrived."""
        if not self.shape.numel:
            if len(self._early) < EARLY_MAX:
                self._early.append((src, data))
            else:
                self._refuse(src, FrameError(FrameReason.OVERSIZE, "too many early frames"))
            return
        try:
            if src != self.shape.left:
                raise FrameError(FrameReason.UNEXPECTED, f"{src!r} is not our left neighbour")
            frame = decode_compact(data, job=self.shape.job, src=src, dsts=(self.shape.me, "*"),
                                   key=self.key, limits=self.limits)  # fmt: skip
            if not self._seen.first_time(src, frame.seq):
                self.stats.duplicates += 1
                return
            done = self._parts.add(frame)
            if done is None:
                return
            head, body = done
            self._check(head, len(body))
        except FrameError as exc:
            self._refuse(src, exc)
            return
        self.stats.frames_received += 1
        self.stats.body_bytes_received += len(body)
        self._arrived[(head.round, head.step, head.phase)] = len(body)
        self._wake.set()

    def _check(self, head: Frame, size: int) -> None:
        """The chunk the left neighbour sends at this step, of the size it has."""
        s = self.shape
        if head.phase not in PHASES or not 0 <= head.step < s.world - 1:
            raise FrameError(FrameReason.UNEXPECTED, f"position {head.phase} {head.step}")
        if head.round not in (self.round, self.round + 1):
            raise FrameError(FrameReason.UNEXPECTED, f"round {head.round} while at {self.round}")
        _, got = self.plan(s.rank, s.world, head.step, head.phase)
        span = self._bounds()[got]
        meta, body = self._chunk(span)
        seen = {k: head.meta.get(k) for k in ("codec", "numel", "groups", "k")}
        if isinstance(seen["groups"], tuple):
            seen["groups"] = list(seen["groups"])
        want = {k: meta[k] for k in seen}
        if seen != want or size != len(body):
            raise FrameError(FrameReason.SHAPE_MISMATCH,
                             f"{head.phase} step {head.step}: {seen}, {size} bytes; expected "
                             f"{want}, {len(body)} bytes")  # fmt: skip

    def _refuse(self, src: str, exc: FrameError) -> None:
        self.stats.refused += 1
        log.warning("%s refused a ring frame from %s: %s", self.shape.me, src, exc)

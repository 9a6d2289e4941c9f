"""How one agent combines a vector with its peers: compress, feed back, reduce.

`Exchange.reduce` returns the sum over agents of ``scale_i * vec_i`` (so a scale
of 1/N gives the mean, a manifest weight gives the weighted mean). With
group-top-k it applies error feedback before and after compressing and adds what
the `bounded` ring drops to the residual, so no gradient mass is ever lost.
`Exchange.vote` is signSGD's majority vote with error feedback; `Exchange.star`
sends the compressed update to an aggregator endpoint (median, trimmed mean) and
waits for the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fedring.collective.channel import PeerChannel
from fedring.collective.ring import Ring
from fedring.collective.torus import Torus
from fedring.collective.vote import majority_vote
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK, k_for
from fedring.compression.payload import Payload, PayloadLimits
from fedring.compression.quantize import DenseCodec, SignQuantizer
from fedring.compression.schedule import DensitySchedule
from fedring.config import JobSpec
from fedring.transport.base import Deadline

STAR = "aggregator"  # endpoint name of the star's centre


def compress_update(
    vec: torch.Tensor, topk: GroupTopK | None, ef: ErrorFeedback | None, k: int | None = None
) -> tuple[Payload, float]:
    """Error feedback, then group-top-k (dense fp32 without `topk`).

    Returns the payload and the compression error ``||g - sent|| / ||g||``, where g
    is `vec` plus the residual; the residual keeps whatever was not sent.
    """
    sent, missed, norm = _compress_measured(vec, topk, ef, k)
    return sent, missed / norm if norm > 0 else 0.0


def _compress_measured(
    vec: torch.Tensor, topk: GroupTopK | None, ef: ErrorFeedback | None, k: int | None
) -> tuple[Payload, float, float]:
    """`compress_update` with the two norms of its error: ``||g - sent||`` and ``||g||``."""
    if topk is None:
        return DenseCodec("fp32").compress(vec), 0.0, 0.0
    g = ef.compensate(vec) if ef is not None else vec
    sent = topk.compress(g, k=k)
    norm = float(g.norm())
    missed = float((g - sent.decompress()).norm())
    if ef is not None:
        ef.update(sent)
    return sent, missed, norm


@dataclass
class Exchange:
    ring: Ring | Torus
    spec: JobSpec
    numel: int
    ef: ErrorFeedback | None = None
    topk: GroupTopK | None = None
    schedule: DensitySchedule | None = None  # DGC density warm-up
    last_error: float = 0.0  # ||g - sent|| / ||g|| of the last compression
    # update_delay: the gradient computed last round, to be all-reduced this round
    pending: torch.Tensor | None = None
    # ||g - sent||^2 and ||g||^2 over this round's buckets so far (bucket 0 starts afresh)
    _bucket_sq: tuple[float, float] = field(default=(0.0, 0.0), init=False, repr=False)

    @classmethod
    def build(cls, ring: Ring | Torus, spec: JobSpec, numel: int) -> Exchange:
        compressed = spec.compression == "group-topk"
        topk = GroupTopK(spec.group_size, spec.k, spec.value_dtype) if compressed else None  # type: ignore[arg-type]
        feedback = spec.error_feedback and (compressed or spec.aggregation == "vote")
        # DGC momentum correction (opt-in): with sparse gradients, momentum lives in
        # the error feedback (velocity accumulated locally, cleared where sent).
        # Momentum applied after the exchange would multiply every delayed burst of
        # accumulated gradient by 1/(1-m) and diverge (digits falls to 8% at m=0.9).
        momentum = spec.momentum if spec.compressed_sync and spec.momentum_correction else 0.0
        ef = ErrorFeedback(numel, momentum=momentum) if feedback else None
        warmup = spec.density_warmup and compressed
        schedule = (
            DensitySchedule(spec.density, steps_per_stage=spec.density_warmup) if warmup else None
        )
        return cls(ring, spec, numel, ef, topk, schedule)

    @property
    def optimizer_momentum(self) -> float:
        """Momentum for the optimizer: none when the gradients are compressed every
        step (either it runs inside error feedback or the job runs plain EF-SGD)."""
        return 0.0 if self.spec.compressed_sync else self.spec.momentum

    @property
    def channel(self) -> PeerChannel:
        return self.ring.channel

    def _k(self, round: int) -> int | None:
        """k of the DGC density warm-up in this round; None: the codec's own."""
        if self.topk is None or self.schedule is None:
            return None
        return k_for(self.schedule.density(round), self.topk.group_size)

    def _compress(self, vec: torch.Tensor, round: int = 0) -> Payload:
        sent, self.last_error = compress_update(vec, self.topk, self.ef, self._k(round))
        return sent

    def reduce(self, vec: torch.Tensor, *, scale: float, round: int) -> torch.Tensor:
        """Sum over the ring of ``scale * vec``, compressed as the job says."""
        scaled = vec * scale
        if self.topk is None:
            return self.ring.allreduce_dense(scaled, round=round)
        sent = self._compress(scaled, round)
        total, kept = self.ring.allreduce_sparse(sent, policy=self.spec.policy, round=round)  # type: ignore[arg-type]
        if self.ef is not None:
            self.ef.keep(kept)
        return total

    def reduce_bucket(
        self, vec: torch.Tensor, *, span: tuple[int, int], scale: float, round: int, bucket: int
    ) -> torch.Tensor:
        """`reduce` of the entries `span` of the flat vector alone (`vec` is that slice).

        Error feedback works on the same entries of the residual. With `span`
        starting on a group boundary, group-top-k keeps exactly what it keeps over
        the whole vector. Buckets of a round go one after another, 0 first, and
        `last_error` is the error over those reduced so far.
        """
        scaled = vec * scale
        if self.topk is None:
            return self.ring.allreduce_dense(scaled, round=round, bucket=bucket)
        ef = self.ef.part(*span) if self.ef is not None else None
        sent, missed, norm = _compress_measured(scaled, self.topk, ef, self._k(round))
        reduce = self.ring.allreduce_sparse
        total, kept = reduce(sent, policy=self.spec.policy, round=round, bucket=bucket)  # type: ignore[arg-type]
        if ef is not None:
            ef.keep(kept)
        missed_sq, norm_sq = self._bucket_sq if bucket else (0.0, 0.0)
        self._bucket_sq = (missed_sq + missed**2, norm_sq + norm**2)
        self.last_error = (
            math.sqrt(self._bucket_sq[0] / self._bucket_sq[1]) if self._bucket_sq[1] else 0.0
        )
        return total

    def vote(self, vec: torch.Tensor, *, round: int) -> torch.Tensor:
        """Majority of the agents' signs of (vec + residual), as float in {-1, 0, 1}."""
        p = self.ef.compensate(vec) if self.ef is not None else vec
        if self.ef is not None:
            self.ef.update(SignQuantizer(4096).compress(p))  # keep what sign(p)*scale misses
        return majority_vote(self.ring.flat, p, round=round).to(torch.float32)

    def star(self, vec: torch.Tensor, *, round: int) -> torch.Tensor:
        """Send the compressed update to the aggregator; return what it decides."""
        deadline = Deadline.after(self.spec.timeout_s)
        self.channel.send(
            STAR, self._compress(vec, round), round=round, step=0, phase="up", deadline=deadline
        )
        result = self.channel.recv(
            STAR, round=round, step=0, phase="down", deadline=deadline,
            limits=PayloadLimits(max_numel=self.numel),
        )  # fmt: skip
        return result.decompress()

    @property
    def residual_norm(self) -> float:
        return float(self.ef.residual.norm()) if self.ef is not None else 0.0

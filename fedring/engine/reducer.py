"""The reducer: error feedback, then the compressor, then the collective, then the kept residual.

One agent's way of combining a flat float32 vector with its group. The whole
sequence of a compressed all-reduce is four lines (GRACE's split of compressor,
memory and communicator)::

    g = ef.compensate(scale * vec)                  # error feedback: add what was left out
    sent = compressor.compress(g); ef.update(sent)  # group-top-k; the rest stays behind
    total, kept = collective.allreduce_sparse(sent) # the ring (bounded: hops re-select)
    ef.keep(kept)                                   # what the ring dropped is not lost

`allreduce` returns the sum over the group of ``scale_i * vec_i`` (a scale of 1/N
gives the mean, a manifest weight the weighted mean). `vote` is signSGD's majority
vote with error feedback; `star` sends ``scale * vec``, compressed, to the group's
centre over a `Centre` link (`engine.star`: a star job, or median and trimmed mean)
and returns what it decides. What the centre does is the layer above
(`engine.centre`); the reducer only holds the link it is given.

Tuning: `density` first (1% keeps 3 of every 256 entries); leave error feedback
on (without it top-k at 1% loses most of the gradient mass and stalls); the DGC
density warm-up (`density_warmup` rounds per stage at 25%, 6.25%, 1.56%, 0.4%)
keeps the first rounds, where gradients change fastest, nearly dense.

`state_dict` holds plain tensors only (the residual, DGC velocity), so it loads
with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from fedring.collective.channel import PeerChannel
from fedring.collective.vote import majority_vote
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK, k_for
from fedring.compression.payload import Payload
from fedring.compression.policy import choose_density
from fedring.compression.quantize import DenseChunk, DenseCodec, SignQuantizer
from fedring.compression.schedule import DensitySchedule
from fedring.compression.settings import DEFAULT_VALUE_DTYPE, SettingsError, check_codec
from fedring.compression.support import at_support, top_indices
from fedring.compression.values import ValueDtype, float_wire
from fedring.engine.group import Collective
from fedring.engine.star import STAR, Centre
from fedring.transport.base import Deadline

# values on a consensus support travel without scales: int8 and sign go as fp16

__all__ = ["STAR", "Centre", "Collective", "Reducer", "ReducerSettings", "compress_update"]


@dataclass(frozen=True)
class ReducerSettings:
    """How vectors are compressed on their way through the collective.

    Every field is checked when the settings are built (`check_codec`, the one check
    that job files, the Flower mod and the DDP hook share): an unknown codec name,
    a density outside (0, 1] or an unknown value dtype raises `SettingsError` naming
    the field, instead of running dense or clamping k.

    Parameters
    ----------
    compression : {"group-topk", "none"}
        Group-top-k with error feedback, or the plain fp32 ring.
    density : float or "auto"
        Fraction kept in every group of `group_size`, in (0, 1]; or "auto", chosen
        with its warm-up and closing flush from `rounds`, `local` and
        `participation` (`compression.policy`; ``density_auto`` says what and why).
    group_size : int
        G; up to 256 gives one-byte indices.
    value_dtype : {"fp16", "fp32", "bf16", "int8"}
        How kept values travel; fp16 by default here and in the DDP hook.
    timeout_s : float or None
        Deadline of a star exchange (a round trip through the centre). None, the
        default, takes the group's `timeout_s`, the one deadline of every collective
        step; set it only to give the star another deadline.
    consensus : bool
        A star's members send their values on the support the centre announces
        (`compression.support`; set for the robust rules over group-top-k), not
        their own top-k. The centre must run the same protocol
        (`CentreSettings.consensus`).
    """

    compression: Literal["none", "group-topk"] = "group-topk"
    density: float | Literal["auto"] = 0.01  # kept fraction per group, or "auto"
    group_size: int = 256  # G; <= 256 gives uint8 indices
    value_dtype: Literal["fp32", "fp16", "bf16", "int8"] = DEFAULT_VALUE_DTYPE  # type: ignore[assignment]
    error_feedback: bool = True  # off only to measure its effect
    momentum_correction: float = 0.0  # DGC: momentum inside error feedback (0 = off)
    density_warmup: int = 0  # rounds per DGC warm-up stage; 0 = off
    density_flush: int = 0  # the last this many of `rounds` send every entry; 0 = off
    rounds: int = 0  # the job's rounds (agreements): for "auto" and the closing flush
    local: bool = False  # "auto": members agree on parameter deltas (local mode)
    local_steps: int = 1  # "auto": the local steps behind each delta (local mode)
    participation: float = 1.0  # "auto": the fraction of members trained a round
    density_auto: str = ""  # set by density="auto": what it chose and why
    policy: Literal["bounded", "exact"] = "bounded"  # sparse ring policy
    sign_feedback: bool = False  # error feedback for the sign vote (signSGD with EF)
    timeout_s: float | None = None  # star exchange; None: the group's timeout_s
    consensus: bool = False  # star: values on the centre's consensus support

    def __post_init__(self) -> None:
        if self.density == "auto":
            if self.compression == "group-topk":
                self._choose()
            else:  # dense: nothing to choose
                object.__setattr__(self, "density", 0.01)
        check_codec(compression=self.compression, density=self.density,
                    group_size=self.group_size, value_dtype=self.value_dtype,
                    policy=self.policy)  # fmt: skip
        if not 0.0 <= self.momentum_correction < 1.0:
            raise SettingsError("momentum_correction", self.momentum_correction, "in [0, 1)")
        if type(self.density_warmup) is not int or self.density_warmup < 0:
            raise SettingsError("density_warmup", self.density_warmup, "an integer >= 0")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise SettingsError("timeout_s", self.timeout_s, "a number > 0, or None")
        if type(self.density_flush) is not int or not 0 <= self.density_flush <= self.rounds:
            raise SettingsError("density_flush", self.density_flush,
                                f"an integer in [0, rounds={self.rounds}]")  # fmt: skip

    def _choose(self) -> None:
        """Resolve ``density="auto"`` from `rounds`, `local` and `participation`."""
        if type(self.rounds) is not int or self.rounds < 1:
            raise SettingsError("rounds", self.rounds, 'an integer >= 1 with density="auto"')
        plan = choose_density(rounds=self.rounds, local=self.local,
                              participation=self.participation,
                              local_steps=self.local_steps)  # fmt: skip
        for name, value in plan.fields().items():
            object.__setattr__(self, name, value)

    @property
    def k(self) -> int:
        return min(self.group_size, max(1, round(float(self.density) * self.group_size)))

    @property
    def compressed(self) -> bool:
        return self.compression == "group-topk"


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
    # torch.linalg.vector_norm is what Tensor.norm() calls, without its Python layer
    norm = float(torch.linalg.vector_norm(g))
    if ef is None:
        return sent, float(torch.linalg.vector_norm(g - sent.decompress())), norm
    ef.update(sent)  # the residual (g itself) becomes g - sent, bit for bit: no decompress
    return sent, float(torch.linalg.vector_norm(ef.residual)), norm


@dataclass
class Reducer:
    """One agent's reducer over its group's collective (see the module docstring)."""

    collective: Collective
    numel: int
    settings: ReducerSettings = field(default_factory=ReducerSettings)
    last_error: float = 0.0  # ||g - sent|| / ||g|| of the last compression
    centre: Centre | None = None  # a star's centre; None: `STAR` on the ring's channel
    # compression "auto": the coordinator chose a dense plan for this segment (fp32, or
    # the value dtype on a one-step collective: `dense_wire`)
    # (`fedring.choose`); group-top-k stays built for a switch back
    dense: bool = False
    ef: ErrorFeedback | None = field(default=None, init=False)
    topk: GroupTopK | None = field(default=None, init=False)
    schedule: DensitySchedule | None = field(default=None, init=False)
    # ||g - sent||^2 and ||g||^2 over this round's buckets so far (bucket 0 starts afresh)
    _bucket_sq: tuple[float, float] = field(default=(0.0, 0.0), init=False, repr=False)

    def __post_init__(self) -> None:
        s = self.settings
        if s.compressed:
            self.topk = GroupTopK(s.group_size, s.k, s.value_dtype)
        if s.error_feedback and (s.compressed or s.sign_feedback):
            self.ef = ErrorFeedback(self.numel, momentum=s.momentum_correction)
        if s.compressed:
            self.schedule = DensitySchedule.of(float(s.density), s.density_warmup, s.rounds,
                                               s.density_flush)  # fmt: skip

    @property
    def channel(self) -> PeerChannel:
        return self.collective.channel

    @property
    def world(self) -> int:
        return self.collective.world

    @property
    def timeout_s(self) -> float:
        """Deadline of a star exchange: the settings' own, else the group's."""
        t = self.settings.timeout_s
        return self.collective.timeout_s if t is None else t

    @property
    def residual_norm(self) -> float:
        return float(torch.linalg.vector_norm(self.ef.residual)) if self.ef is not None else 0.0

    def _k(self, round: int) -> int | None:
        """k of the DGC density warm-up in this round; None: the codec's own."""
        if self.topk is None or self.schedule is None:
            return None
        return k_for(self.schedule.density(round), self.topk.group_size)

    def compress(self, vec: torch.Tensor, round: int = 0) -> Payload:
        """Error feedback and the compressor on `vec` (dense fp32 when uncompressed)."""
        sent, self.last_error = compress_update(vec, self.topk, self.ef, self._k(round))
        return sent

    def allreduce(self, vec: torch.Tensor, *, scale: float, round: int) -> torch.Tensor:
        """Sum over the group of ``scale * vec``, compressed as the settings say."""
        scaled = vec * scale
        if self.topk is None or self.dense:
            return self._dense(self._flushed(scaled, self.ef), round=round)
        sent = self.compress(scaled, round)
        total, kept = self.collective.allreduce_sparse(
            sent,  # type: ignore[arg-type]  # group-top-k gives SparseGroups
            policy=self.settings.policy, round=round,
        )
        if self.ef is not None:
            self.ef.keep(kept)
        return total

    def allreduce_bucket(
        self, vec: torch.Tensor, *, span: tuple[int, int], scale: float, round: int, bucket: int
    ) -> torch.Tensor:
        """`allreduce` of the entries `span` of the flat vector alone (`vec` is that slice).

        Error feedback works on the same entries of the residual. With `span`
        starting on a group boundary, group-top-k keeps exactly what it keeps over
        the whole vector. Buckets of a round go one after another, 0 first, and
        `last_error` is the error over those reduced so far.
        """
        scaled = vec * scale
        ef = self.ef.part(*span) if self.ef is not None else None
        if self.topk is None or self.dense:
            return self._dense(self._flushed(scaled, ef), round=round, bucket=bucket)
        sent, missed, norm = _compress_measured(scaled, self.topk, ef, self._k(round))
        total, kept = self.collective.allreduce_sparse(
            sent,  # type: ignore[arg-type]  # group-top-k gives SparseGroups
            policy=self.settings.policy, round=round, bucket=bucket,
        )
        if ef is not None:
            ef.keep(kept)
        missed_sq, norm_sq = self._bucket_sq if bucket else (0.0, 0.0)
        self._bucket_sq = (missed_sq + missed**2, norm_sq + norm**2)
        self.last_error = (
            math.sqrt(self._bucket_sq[0] / self._bucket_sq[1]) if self._bucket_sq[1] else 0.0
        )
        return total

    @property
    def dense_wire(self) -> ValueDtype:
        """How a dense round's entries travel: fp32, except where ``compression = "auto"``
        chose a dense plan on a one-step collective (`collective.fanout`): there at the
        job's value dtype (int8 and sign as fp16), as group-top-k sends its values."""
        if not self.dense or not self.collective.one_step:
            return "fp32"
        return float_wire(self.settings.value_dtype)

    def _dense(self, vec: torch.Tensor, *, round: int, bucket: int | None = None) -> torch.Tensor:
        wire = self.dense_wire
        if wire == "fp32":  # the call every collective has taken from the start
            return self.collective.allreduce_dense(vec, round=round, bucket=bucket)
        return self.collective.allreduce_dense(vec, round=round, bucket=bucket, wire=wire)

    def _flushed(self, scaled: torch.Tensor, ef: ErrorFeedback | None) -> torch.Tensor:
        """`scaled` for a dense round: under group-top-k switched to dense, plus what
        error feedback still holds, which is then empty (flushed, not kept: the dense
        round delivers it now rather than whenever top-k next runs, or never)."""
        self.last_error = 0.0  # every entry goes out
        if self.topk is None or ef is None or not bool(ef.residual.any()):
            return scaled
        out = ef.compensate(scaled).clone()
        ef.reset()
        return out

    def allreduce_dense(self, vec: torch.Tensor, *, round: int, bucket: int) -> torch.Tensor:
        """Plain fp32 sum over the group, uncompressed (e.g. BatchNorm statistics);
        `bucket` tags its frames apart from the round's gradient."""
        return self.collective.allreduce_dense(vec, round=round, bucket=bucket)

    def vote(self, vec: torch.Tensor, *, round: int) -> torch.Tensor:
        """Majority of the agents' signs of (vec + residual), as float in {-1, 0, 1}."""
        p = self.ef.compensate(vec) if self.ef is not None else vec
        if self.ef is not None:
            self.ef.update(SignQuantizer(4096).compress(p))  # keep what sign(p)*scale misses
        return majority_vote(self.collective.flat, p, round=round).to(torch.float32)

    def star(self, vec: torch.Tensor, *, round: int, scale: float = 1.0) -> torch.Tensor:
        """Send ``scale * vec``, compressed, to the centre; return what it decides."""
        vec = vec * scale if scale != 1.0 else vec
        if self.consensus:
            return self._star_on_support(vec, round)
        sent = self.compress(vec, round)
        return self._centre.exchange(sent, round=round, numel=self.numel, timeout_s=self.timeout_s)

    def star_result(self, *, round: int) -> torch.Tensor:
        """A member that sits this round out (client sampling): only the centre's reply."""
        return self._centre.result(round=round, numel=self.numel, timeout_s=self.timeout_s)

    @property
    def consensus(self) -> bool:
        """Star rounds on the centre's consensus support (group-top-k only)."""
        return self.settings.consensus and self.topk is not None

    def _star_on_support(self, vec: torch.Tensor, round: int) -> torch.Tensor:
        """One consensus round (`compression.support`): vote with the top-k of the
        error-compensated update, take the round's support, send the values on it;
        error feedback keeps everything off the support."""
        assert self.topk is not None
        link, deadline = self._centre, Deadline.after(self.timeout_s)
        g = self.ef.compensate(vec) if self.ef is not None else vec.clone()
        k = self._k(round) or self.topk.k
        link.vote(top_indices(g, group_size=self.topk.group_size, k=k), round=round,
                  deadline=deadline)  # fmt: skip
        support = link.support(round=round, numel=self.numel, deadline=deadline)
        if support.group_size != self.topk.group_size:
            raise ValueError(
                f"round {round}: the centre's support has groups of {support.group_size}, "
                f"this member {self.topk.group_size}"
            )
        norm = float(torch.linalg.vector_norm(g))
        sent = at_support(g, support, float_wire(self.settings.value_dtype))
        if self.ef is not None:
            self.ef.update(sent)  # g, the residual itself, keeps what was not sent
        else:
            sent.add_to(g, alpha=-1.0)
        self.last_error = float(torch.linalg.vector_norm(g)) / norm if norm > 0 else 0.0
        values = DenseChunk(support.size, 0, sent.values.reshape(-1))
        return link.exchange_on(values, round=round, numel=self.numel, deadline=deadline)

    @property
    def _centre(self) -> Centre:
        return self.centre or Centre(self.channel)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The error-feedback memory (empty without it); plain tensors only."""
        return {} if self.ef is None else self.ef.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if self.ef is None:
            if state:
                raise ValueError("state holds a residual but this reducer has no error feedback")
            return
        if not state:
            self.ef.reset()
            return
        self.ef.load_state_dict(state)

"""A DDP communication hook: fedring's group-top-k with error feedback on a torch process group.

Modelled on torch's PowerSGD hook: the hyper-parameters and all mutable state
(per-bucket residuals, the step counter, byte counters) live in one
`GroupTopKState`; `group_topk_hook` itself holds nothing.

    ddp = DistributedDataParallel(model)
    state = GroupTopKState(process_group=None, density=0.01, start_compress_iter=10)
    ddp.register_comm_hook(state, group_topk_hook)

Each compressed step, every rank compresses its bucket (plus its residual) with
`GroupTopK`, all-gathers the fixed-size payloads (k entries in every group, so
every rank's payload has the same size), and sums the N decompressed payloads in
rank order and divides by N. Every rank does the same arithmetic on the same
bytes, so the replicas stay bit-identical.

Tuning guide
------------
1. ``density`` first. 1% with error feedback trains small models like dense SGD.
   The density is ``k / group_size`` with ``k = round(density * group_size)`` and at
   least 1, so 1% of 256 keeps 3 a group (1.17%); to go below ``1 / group_size``
   raise ``group_size`` (indices become uint16 above 256).
2. ``start_compress_iter``: the first steps run the plain all-reduce. Early
   gradients are large and turn fast, and top-k of them sends a poor direction
   while the residual is still empty; a dense start of a few percent of the run
   (or the learning-rate warm-up) costs little accuracy and, over a long run,
   little traffic. It must be at least 2 with error feedback on: DDP rebuilds
   its buckets after its first step, and residuals keyed by bucket index would
   otherwise belong to buckets of another size.
3. ``value_dtype``: "fp16" halves the value bytes at no measurable cost; "int8"
   and "sign" should only run with error feedback.
4. ``use_error_feedback`` stays on. Top-k is biased: without a residual, the 99%
   of small entries are never applied at all. With it, nothing is dropped, only
   delayed (``sent + residual == gradient + old residual``, bit for bit).
5. The optimizer's momentum. Error feedback releases a coordinate's held-back
   mass in bursts, and heavy-ball momentum then keeps re-applying each burst. On
   digits (4 ranks, 300 steps, `bench/ddp_hook.py`) SGD with momentum 0.9 at lr
   0.05 reached 0.925 test accuracy at 1% against 0.978 dense; plain SGD at the
   same effective step (lr 0.5, no momentum) reached 0.981 against 0.983.
   Measure both on your task before keeping momentum.

Cost: a ring all-gather makes each rank send ``(N - 1) x payload`` bytes, where a
ring all-reduce sends ``2 (N - 1) / N x bucket`` bytes. At 1% (3 of 256, fp32
values, uint8 indices: 5 bytes an entry) the payload is 1.5% of the fp32 bucket,
so the all-gather stays cheaper up to about N = 130 ranks.

Limits: CPU float32 buckets on a group that can all-gather CPU uint8 tensors
(gloo); fedring's compressor runs on the CPU.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket and Future[Tensor] types.

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.compression.payload import PayloadLimits
from fedring.compression.sparse import SparseGroups
from fedring.compression.settings import check_codec
from fedring.compression.values import VALUE_DTYPES, ValueDtype

_DDP_REBUILD_STEPS = 2  # DDP rebuilds its buckets after step 0; residuals must wait for that
_COUNTERS = ("iter", "sent_bytes", "payload_bytes", "dense_equivalent_bytes")


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `nbytes`: ``2 (N - 1) / N x nbytes``."""
    return 2 * (world - 1) * nbytes // world


class GroupTopKState:
    """Hyper-parameters and mutable state of `group_topk_hook`; one per DDP model.

    Parameters
    ----------
    process_group : ProcessGroup or None
        The group to reduce over; None for the default (world) group.
    density : float
        Fraction kept in every group, in (0, 1]; see the module's tuning guide.
    group_size : int
        Entries per group; up to 256 gives one-byte indices.
    value_dtype : {"fp32", "fp16", "bf16", "int8", "sign"}
        How kept values travel.
    start_compress_iter : int
        Steps of plain all-reduce before compression starts (>= 2 with error feedback).
    use_error_feedback : bool
        Keep what was not sent in a per-bucket residual and add it to the next step.

    Counters (this rank, all steps so far): `sent_bytes` is what it put on the wire
    by the ring convention (all-reduce ``2 (N-1)/N x bucket``, all-gather
    ``(N-1) x payload``); `payload_bytes` is one copy of its compressed payloads
    (values, indices, scales); `dense_equivalent_bytes` is what all-reduce on every
    step would have sent.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        density: float = 0.01,
        group_size: int = 256,
        value_dtype: ValueDtype = "fp16",
        start_compress_iter: int = 10,
        use_error_feedback: bool = True,
    ) -> None:
        check_codec(density=density, group_size=group_size, value_dtype=value_dtype,
                    value_dtypes=VALUE_DTYPES)  # shared with ReducerSettings and JobSpec
        if start_compress_iter < 0:
            raise ValueError(f"start_compress_iter={start_compress_iter} must be >= 0")
        if use_error_feedback and start_compress_iter < _DDP_REBUILD_STEPS:
            raise ValueError(
                f"start_compress_iter={start_compress_iter} must be >= {_DDP_REBUILD_STEPS} "
                "with error feedback: DDP rebuilds its buckets after the first step"
            )
        self.process_group = process_group
        self.compressor = GroupTopK.from_density(density, group_size, value_dtype)
        self.start_compress_iter = start_compress_iter
        self.use_error_feedback = use_error_feedback
        self.error_feedback: dict[int, ErrorFeedback] = {}  # keyed by bucket index
        self.iter = 0  # completed DDP steps (counted on the last bucket)
        self.sent_bytes = 0
        self.payload_bytes = 0
        self.dense_equivalent_bytes = 0
        self._steps_here = 0  # steps since this object was built or loaded

    @property
    def compressing(self) -> bool:
        """Whether the current step compresses (False during the dense warm-up)."""
        settled = not self.use_error_feedback or self._steps_here >= _DDP_REBUILD_STEPS
        return self.iter >= self.start_compress_iter and settled

    def residual_norm(self) -> float:
        """L2 norm of all residuals together; 0.0 before the first compressed step."""
        sq = sum(float(ef.residual.square().sum()) for ef in self.error_feedback.values())
        return sq**0.5

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Counters and residuals as plain tensors, so checkpoints load with ``weights_only``."""
        state = {name: torch.tensor(getattr(self, name), dtype=torch.int64) for name in _COUNTERS}
        for index, ef in self.error_feedback.items():
            state[f"residual.{index}"] = ef.residual.clone()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore counters and residuals; the next two steps run dense (DDP rebuilds buckets)."""
        for name in _COUNTERS:
            setattr(self, name, int(state[name]))
        self.error_feedback = {}
        for key, residual in state.items():
            if key.startswith("residual."):
                ef = ErrorFeedback(residual.numel())
                ef.residual.copy_(residual)
                self.error_feedback[int(key.removeprefix("residual."))] = ef
        self._steps_here = 0

    def _memory(self, index: int, numel: int) -> ErrorFeedback:
        ef = self.error_feedback.setdefault(index, ErrorFeedback(numel))
        if ef.numel != numel:
            raise ValueError(
                f"bucket {index} has {numel} entries, its residual {ef.numel}: the buckets "
                "changed after compression started (another model or bucket_cap_mb?)"
            )
        return ef

    def _end_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1
            self._steps_here += 1


def group_topk_hook(
    state: GroupTopKState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group with group-top-k and error feedback.

    Register with ``ddp.register_comm_hook(state, group_topk_hook)``. Steps before
    ``state.start_compress_iter`` run torch's plain all-reduce hook.

    Returns
    -------
    Future[Tensor]
        Completes with the bucket's buffer holding the mean of the ranks'
        decompressed payloads.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("group_topk_hook needs an initialised process group")
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    if buffer.device.type != "cpu" or buffer.dtype != torch.float32:
        raise TypeError(f"group_topk_hook needs CPU float32 buckets, got {buffer.device} "
                        f"{buffer.dtype}")  # fmt: skip
    dense_bytes = ring_allreduce_bytes(buffer.numel() * 4, world)
    state.dense_equivalent_bytes += dense_bytes
    if not state.compressing:
        state.sent_bytes += dense_bytes
        state._end_bucket(bucket)
        return allreduce_hook(group, bucket)

    grad = buffer.detach()
    ef = state._memory(bucket.index(), grad.numel()) if state.use_error_feedback else None
    payload = state.compressor.compress(grad if ef is None else ef.compensate(grad))
    if ef is not None:
        ef.update(payload)
    mine, layout = _pack(payload)
    state.payload_bytes += mine.numel()
    state.sent_bytes += (world - 1) * mine.numel()
    state._end_bucket(bucket)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)

    def average(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # re-raises a failed all-gather
        buffer.zero_()
        for blob in gathered:  # rank order: every rank adds in the same order
            _unpack(blob, layout).add_to(buffer)
        return buffer.div_(world)

    assert work is not None  # async_op=True always returns a Work
    return work.get_future().then(average)


# --- payload <-> one flat uint8 tensor, for a fixed-size all-gather ---------------------

_LIMITS = PayloadLimits()


@dataclass(frozen=True)
class _Layout:
    """How a packed payload splits into arrays; the same on every rank of a step."""

    meta: dict[str, Any]
    arrays: tuple[tuple[str, str, np.dtype[Any], tuple[int, ...]], ...]


def _pack(payload: SparseGroups) -> tuple[torch.Tensor, _Layout]:
    """The payload's wire arrays (indices, values, scales) back to back, as bytes."""
    meta, arrays = payload.to_wire()
    layout = _Layout(meta, tuple((name, wire, a.dtype, a.shape) for name, wire, a in arrays))
    blob = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                           for _, _, a in arrays])  # fmt: skip
    return torch.from_numpy(blob), layout


def _unpack(blob: torch.Tensor, layout: _Layout) -> SparseGroups:
    """Decode another rank's bytes with our own layout through the checked wire decoder."""
    raw = blob.numpy()
    arrays: dict[str, tuple[str, np.ndarray]] = {}
    pos = 0
    for name, wire, dtype, shape in layout.arrays:
        n = int(np.prod(shape)) * dtype.itemsize
        # copy: the slice may sit at an offset not aligned for `dtype`
        arrays[name] = (wire, raw[pos : pos + n].copy().view(dtype).reshape(shape))
        pos += n
    return SparseGroups.from_wire(layout.meta, arrays, _LIMITS)

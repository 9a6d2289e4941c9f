"""A DDP communication hook: fedring's group-top-k with error feedback on a torch process group.

Modelled on torch's PowerSGD hook: the hyper-parameters and all mutable state
(per-bucket residuals, the step counter, byte counters) live in one
`GroupTopKState`; `group_topk_hook` itself holds nothing.

    from fedring.engine.ddp_hook import GroupTopKState, group_topk_hook

    ddp = DistributedDataParallel(model)
    state = GroupTopKState(process_group=None, density=0.01, start_compress_iter=10)
    ddp.register_comm_hook(state, group_topk_hook)

docs/ddp_hook.md has the example beside PowerSGD's, the defaults and what it supports.

Each compressed step, every rank compresses its bucket (plus its residual) with
`GroupTopK`, all-gathers the fixed-size payloads (k entries in every group, so
every rank's payload has the same size), and sums the N decompressed payloads in
rank order and divides by N. Every rank does the same arithmetic on the same
bytes, so the replicas stay bit-identical.

Before compressing a bucket the ranks agree, in one all-reduce of 4 bytes a
parameter, on two things:

- Whether any rank's bucket holds an inf or a NaN. Then the bucket goes through
  torch's plain all-reduce, so the overflow shows exactly where DDP would show it
  (GradScaler skips the step, ``clip_grad_norm_(error_if_nonfinite=True)`` raises),
  and the residual stays as it was before the step: the bad gradient never enters it.
- Which parameters got no gradient on any rank (their slice is zero everywhere, as
  DDP fills it with ``find_unused_parameters=True``). DDP leaves their ``.grad``
  alone, so their residual is held, not sent, until they are used again.

Buckets of any float dtype on any device: the hook compresses in float32 (float64
for float64 buckets) and returns the bucket's dtype. CPU buckets of up to 32 bits
go through fedring's `GroupTopK` and its checked wire decoder; CUDA and float64 buckets
through the same selection in torch ops on the bucket's device (`ddp_codec`), the
residual kept there too. Over NCCL the payloads are all-gathered on the device;
over gloo a CUDA payload is copied to the host for the all-gather (it is small).

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
   its buckets once, before its second step (before its third with
   ``static_graph=True``), and residuals keyed by bucket index would otherwise
   belong to buckets of another size. A loaded or unpickled state runs two dense
   steps first for the same reason.
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

Limits: one state per DDP model (a second model's bucket is refused: the
residuals would mix); "sign" values only on CPU buckets of up to 32 bits (their
bit packing runs in numpy); a used parameter whose gradient is exactly zero on every rank waits with
the unused ones (delayed, not lost). The agreement all-reduce waits for its answer,
so on CUDA each compressed bucket syncs the host with the device once.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket and Future[Tensor] types.

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.compression.policy import choose_density
from fedring.compression.settings import SettingsError, check_codec
from fedring.compression.values import VALUE_DTYPES, ValueDtype
from fedring.engine.ddp_codec import pack, working_dtype

# DDP rebuilds its buckets once: before its second step, or before its third with
# static_graph=True (its first step then only records the graph). Residuals keyed by
# bucket index must wait until the buckets no longer change.
_DDP_REBUILD_STEPS = 2
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
    density : float or "auto"
        Fraction kept in every group, in (0, 1]; see the module's tuning guide. "auto"
        chooses it from `steps` as jobs do (`compression.policy`: 1% from 300 steps,
        3 / steps below, at most 22%).
    group_size : int
        Entries per group; up to 256 gives one-byte indices.
    value_dtype : {"fp32", "fp16", "bf16", "int8", "sign"}
        How kept values travel ("sign" on CPU buckets of up to 32 bits only).
    start_compress_iter : int
        Steps of plain all-reduce before compression starts (>= 2 with error feedback).
    use_error_feedback : bool
        Keep what was not sent in a per-bucket residual and add it to the next step.
    steps : int
        The training's optimizer steps; needed with ``density="auto"`` only.

    Notes
    -----
    Counters (this rank, all steps so far): `sent_bytes` is what it put on the wire
    by the ring convention (all-reduce ``2 (N-1)/N x bucket``, all-gather
    ``(N-1) x payload``, the agreement all-reduce of 4 bytes a parameter);
    `payload_bytes` is one copy of its compressed payloads (values, indices,
    scales); `dense_equivalent_bytes` is what all-reduce on every step would have
    sent; `nonfinite_buckets` counts buckets all-reduced dense because some rank's
    gradient held an inf or a NaN.

    Pickling keeps the settings, counters and residuals and drops the process group
    (the copy runs on the default group until `process_group` is set) and the model
    it served: like a loaded state, the copy runs two dense steps on its new DDP.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        density: float | str = 0.01,
        group_size: int = 256,
        value_dtype: ValueDtype = "fp16",
        start_compress_iter: int = 10,
        use_error_feedback: bool = True,
        steps: int = 0,
    ) -> None:
        # --- argument checks ---
        if density == "auto":  # `compression.policy` for a job of `steps` sync steps
            if type(steps) is not int or steps < 1:
                raise SettingsError("steps", steps, 'an integer >= 1 with density="auto"')
            density = choose_density(rounds=steps).density
        check_codec(density=density, group_size=group_size, value_dtype=value_dtype,
                    value_dtypes=VALUE_DTYPES)  # shared with ReducerSettings and JobSpec
        if start_compress_iter < 0:
            raise ValueError(f"start_compress_iter={start_compress_iter} must be >= 0")
        if use_error_feedback and start_compress_iter < _DDP_REBUILD_STEPS:
            raise ValueError(
                f"start_compress_iter={start_compress_iter} must be >= {_DDP_REBUILD_STEPS} "
                "with error feedback: DDP rebuilds its buckets during its first steps"
            )
        # --- end of argument checks ---
        self.process_group = process_group
        self.compressor = GroupTopK.from_density(float(density), group_size, value_dtype)
        self.start_compress_iter = start_compress_iter
        self.use_error_feedback = use_error_feedback
        self.error_feedback: dict[int, ErrorFeedback] = {}  # keyed by bucket index
        self.iter = 0  # completed DDP steps (counted on the last bucket)
        self.sent_bytes = 0
        self.payload_bytes = 0
        self.dense_equivalent_bytes = 0
        self.nonfinite_buckets = 0
        self._steps_here = 0  # steps since this object was built, loaded or unpickled
        self._forget_model()

    @property
    def compressing(self) -> bool:
        """Whether the current step compresses (False during the dense warm-up)."""
        settled = not self.use_error_feedback or self._steps_here >= _DDP_REBUILD_STEPS
        return self.iter >= self.start_compress_iter and settled

    def residual_norm(self) -> float:
        """L2 norm of all residuals together; 0.0 before the first compressed step."""
        sq = sum(float(ef.residual.double().square().sum()) for ef in self.error_feedback.values())
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
                ef.residual = residual.detach().clone()  # moved to the bucket's device on use
                self.error_feedback[int(key.removeprefix("residual."))] = ef
        self._steps_here = 0
        self._forget_model()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["process_group"] = None  # process groups do not pickle; PowerSGDState does this
        state["_steps_here"] = 0  # the copy serves a new DDP, whose buckets rebuild
        state["_params"], state["_model_seen"] = {}, False  # weak references do not pickle
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _forget_model(self) -> None:
        self._params: dict[int, weakref.ref[torch.Tensor]] = {}  # the model this state serves
        self._model_seen = False  # True once a whole step's buckets have been seen

    def _claim(self, bucket: dist.GradBucket) -> None:
        """Refuse a bucket of another model: its residuals would mix with this one's."""
        params = bucket.parameters()
        if not self._model_seen:
            self._params.update((id(p), weakref.ref(p)) for p in params)
            self._model_seen = bucket.is_last()
            return
        for p in params:
            ref = self._params.get(id(p))
            if ref is None or ref() is not p:
                raise ValueError(
                    "one GroupTopKState per DDP model: this state already serves another "
                    f"model, and bucket {bucket.index()} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not in it (their residuals would mix)"
                )

    def _memory(self, index: int, like: torch.Tensor) -> ErrorFeedback:
        ef = self.error_feedback.setdefault(index, ErrorFeedback(like.numel()))
        if ef.numel != like.numel():
            raise ValueError(
                f"bucket {index} has {like.numel()} entries, its residual {ef.numel}: the "
                "buckets changed after compression started (bucket_cap_mb?)"
            )
        if ef.residual.device != like.device or ef.residual.dtype != like.dtype:
            ef.residual = ef.residual.to(like)  # first use, or a checkpoint from elsewhere
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
    ``state.start_compress_iter`` run torch's plain all-reduce hook, and so does a
    bucket that holds an inf or a NaN on any rank (its residual is left as it was).

    Returns
    -------
    Future[Tensor]
        Completes with the bucket's buffer holding the mean of the ranks'
        decompressed payloads, in the bucket's dtype.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("group_topk_hook needs an initialised process group")
    state._claim(bucket)
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    dense_bytes = ring_allreduce_bytes(buffer.numel() * buffer.element_size(), world)
    state.dense_equivalent_bytes += dense_bytes
    if state.compressing:
        agreed = _agree(state, bucket, group, world)
        if agreed is not None:
            return _compressed(state, bucket, group, world, agreed)
        state.nonfinite_buckets += 1
    state.sent_bytes += dense_bytes
    state._end_bucket(bucket)
    return allreduce_hook(group, bucket)  # inf and NaN reach every rank, as without a hook


@dataclass(frozen=True)
class _Agreed:
    """What all ranks agreed on before compressing a bucket."""

    idle: tuple[tuple[int, int], ...]  # [start, end) of parameters zero on every rank


def _agree(
    state: GroupTopKState, bucket: dist.GradBucket, group: dist.ProcessGroup, world: int
) -> _Agreed | None:
    """One small all-reduce (MAX): did any rank's bucket hold an inf or a NaN (None: send
    it dense), and which parameters got no gradient on any rank.

    An idle parameter's slice is zero in every rank's bucket (DDP fills it so with
    find_unused_parameters=True) and DDP leaves its ``.grad`` alone, so whatever the
    hook sent there would be lost: its residual waits instead. A used parameter whose
    gradient is exactly zero on every rank waits the same way; that only delays it.
    """
    buffer = bucket.buffer()
    numels = [p.numel() for p in bucket.parameters()]
    if sum(numels) != buffer.numel():  # not laid out back to back: judge the bucket whole
        numels = [buffer.numel()]
    bounds = [0, *accumulate(numels)]
    ends = torch.tensor(bounds[1:], device=buffer.device) - 1
    nonzero = buffer.ne(0).cumsum(0, dtype=torch.int32)[ends]
    flags = torch.empty(1 + len(numels), dtype=torch.int32, device=buffer.device)
    flags[0] = ~torch.isfinite(buffer).all()
    flags[1:] = nonzero.diff(prepend=nonzero.new_zeros(1)).gt(0)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    state.sent_bytes += ring_allreduce_bytes(flags.numel() * 4, world)
    agreed = flags.tolist()
    if agreed[0]:
        return None
    idle = tuple((bounds[i], bounds[i + 1]) for i, used in enumerate(agreed[1:]) if not used)
    return _Agreed(idle)


def _compressed(
    state: GroupTopKState,
    bucket: dist.GradBucket,
    group: dist.ProcessGroup,
    world: int,
    agreed: _Agreed,
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    grad = buffer.detach().to(working_dtype(buffer.dtype))
    ef = state._memory(bucket.index(), grad) if state.use_error_feedback else None
    x = grad if ef is None else ef.compensate(grad)
    if agreed.idle:  # their residual waits; DDP would drop what is sent there
        x = x.clone()
        for start, end in agreed.idle:
            x[start:end] = 0
    packed = pack(state.compressor, x)
    if ef is not None:
        packed.subtract_sent(ef.residual)
    mine = packed.blob
    state.payload_bytes += mine.numel()
    state.sent_bytes += (world - 1) * mine.numel()
    state._end_bucket(bucket)
    if mine.device.type != "cpu" and dist.get_backend(group) == "gloo":
        mine = mine.cpu()  # gloo all-gathers host tensors; the payload is small
    gathered = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)

    def average(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # re-raises a failed all-gather
        out = buffer if buffer.dtype == grad.dtype else torch.empty_like(grad)
        packed.mean_into(gathered, out)  # rank order: every rank adds in the same order
        return out if out is buffer else buffer.copy_(out)

    assert work is not None  # async_op=True always returns a Work
    return work.get_future().then(average)

"""torch's PowerSGD DDP hook with its bytes counted: shared by the DDP benches.

`register_powersgd(ddp, world, rank=R)` registers `powerSGD_hook` (error feedback
and warm start on, torch's defaults) on a `DistributedDataParallel` and returns a
`CountedPowerSGD` whose ``sent_bytes`` follows the ring convention: an all-reduce
of B bytes sends ``2 (N - 1) / N x B``. It counts PowerSGD's three all-reduces
(uncompressed tensors, P, Q) from torch's own element counter, and the whole bucket
during the dense warm-up (``start_iter`` steps).
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket and Future[Tensor] types.

import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

from fedring.engine.ddp_hook import ring_allreduce_bytes


class CountedPowerSGD:
    """PowerSGD's state plus the bytes its all-reduces sent."""

    def __init__(self, inner: psgd.PowerSGDState, world: int) -> None:
        self.inner, self.world, self.sent_bytes = inner, world, 0

    def step(self) -> None:
        pass

    def residual_norm(self) -> float:
        return math.sqrt(sum(float(e.square().sum()) for e in self.inner.error_dict.values()))


def counted_powersgd_hook(
    meter: CountedPowerSGD, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    state = meter.inner
    dense = state.iter < state.start_powerSGD_iter
    before = state.total_numel_after_compression
    numel = bucket.buffer().numel()
    fut = psgd.powerSGD_hook(state, bucket)  # counts its compressed numel synchronously
    if not dense:
        numel = state.total_numel_after_compression - before
    meter.sent_bytes += ring_allreduce_bytes(numel * 4, meter.world)
    return fut


def register_powersgd(
    ddp: DistributedDataParallel, world: int, *, rank: int, start_iter: int, seed: int
) -> CountedPowerSGD:
    """PowerSGD of matrix rank `rank` on `ddp`, dense for the first `start_iter` steps."""
    if rank < 1:
        raise ValueError(f"PowerSGD rank={rank} must be >= 1")
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                               start_powerSGD_iter=start_iter, random_seed=seed)  # fmt: skip
    meter = CountedPowerSGD(state, world)
    ddp.register_comm_hook(meter, counted_powersgd_hook)
    return meter

"""The running statistics of a model's norm layers, averaged over the group at each sync.

A `DistributedOptimizer` built with ``model=`` averages the floating buffers named
``running_mean`` and ``running_var`` (torch's BatchNorm and InstanceNorm) at every
sync point: a plain fp32 mean, uncompressed, in frames tagged apart from the
gradient's (`BUFFERS_BUCKET`). Other buffers, integer ones (``num_batches_tracked``)
included, stay each member's own.
"""

from __future__ import annotations

import torch
from torch import nn

from fedring.engine.reducer import Reducer
from fedring.training.models import set_flat_params

BUFFERS_BUCKET = -1  # frame tag of the buffers' all-reduce, apart from the gradient's
RUNNING_STATS = ("running_mean", "running_var")  # the buffers averaged at each sync


def running_stats(model: nn.Module | None) -> list[torch.Tensor]:
    """The floating buffers named as torch's norm layers name their running statistics."""
    if model is None:
        return []
    return [b for name, b in model.named_buffers()
            if b.is_floating_point() and name.rsplit(".", 1)[-1] in RUNNING_STATS]  # fmt: skip


def average(buffers: list[torch.Tensor], reducer: Reducer, round: int) -> None:
    """Replace `buffers` by their mean over the group (a collective call for `round`)."""
    if not buffers or reducer.world == 1:
        return
    flat = torch.cat([b.detach().reshape(-1).to(torch.float32) for b in buffers])
    mean = reducer.allreduce_dense(flat / reducer.world, round=round, bucket=BUFFERS_BUCKET)
    set_flat_params(buffers, mean)

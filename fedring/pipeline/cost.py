"""What each layer of a model costs, measured on a sample micro-batch, not guessed.

`measure_layers` runs the layers one after another on a sample input, and times
a forward plus backward of each (median of `repeats`, one torch thread, after a
warm-up), with the gradient of its input where the input needs one, as it will
inside a pipeline stage. Parameter bytes and the bytes of each layer's output
(what a stage keeps for backward) are computed from the tensors themselves.

`host_gflops` is this machine's single-thread fp64 matmul speed; a board's time
for a layer is the host's measured time x host GFLOPS / board GFLOPS (the boards'
figure is HPL, fp64), the same rule the simulator's virtual clock uses.

    >>> import torch; from torch import nn
    >>> costs = measure_layers([nn.Linear(4, 8), nn.ReLU()], torch.zeros(2, 4), repeats=1)
    >>> [c.param_bytes for c in costs], [c.out_shape for c in costs]
    ([160, 0], [(8,), (8,)])
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


class StageSplitError(ValueError):
    """A model that cannot be cut into stages (not sequential, too few layers)."""


@dataclass(frozen=True)
class LayerCost:
    """One layer's measured cost for one micro-batch on this host."""

    index: int
    name: str  # the layer's class, e.g. "Linear"
    params: int  # parameter entries
    param_bytes: int  # fp32 bytes of its parameters
    out_shape: tuple[int, ...]  # one sample's output, without the batch dimension
    activation_bytes: int  # fp32 bytes of its output for one micro-batch
    seconds: float  # forward + backward of one micro-batch on this host, one thread


def layers_of(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The layers to split: an `nn.Sequential`'s children or a task's list of stage modules."""
    listed = isinstance(model, Sequence) and all(isinstance(m, nn.Module) for m in model)
    if isinstance(model, nn.Sequential) or listed:
        layers = list(model)  # type: ignore[arg-type]
    else:
        raise StageSplitError(
            f"a pipeline splits an nn.Sequential or a list of modules, not {type(model).__name__}"
        )
    if not layers:
        raise StageSplitError("the model has no layers to split")
    return layers


def _time_layer(layer: nn.Module, x: torch.Tensor, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):  # two warm-up runs
        inp = x.detach().requires_grad_(x.is_floating_point() and x.requires_grad)
        start = time.perf_counter()
        out = layer(inp)
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        if i >= 2:
            times.append(time.perf_counter() - start)
    layer.zero_grad(set_to_none=True)
    return statistics.median(times)


def measure_layers(
    layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 5
) -> list[LayerCost]:
    """The cost of each of `layers` on `sample` (one micro-batch of inputs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    costs = []
    try:
        x = sample.detach()
        for i, layer in enumerate(layers):
            seconds = _time_layer(layer, x.requires_grad_(i > 0 and x.is_floating_point()),
                                  repeats)  # fmt: skip
            with torch.no_grad():
                x = layer(x.detach())
            params = sum(p.numel() for p in layer.parameters())
            costs.append(LayerCost(
                i, type(layer).__name__, params, params * 4, tuple(x.shape[1:]),
                x.numel() * 4, seconds,
            ))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return costs


def host_gflops(size: int = 384, repeats: int = 7) -> float:
    """This host's single-thread fp64 matmul GFLOPS (the boards' HPL figure is fp64)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / best / 1e9

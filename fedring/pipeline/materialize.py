"""A stage's layers built alone: a process that trains one stage never holds the rest.

The whole model is built on PyTorch's ``meta`` device (shapes only, no memory); the
layers of one stage are then given real storage and initialised layer by layer
from ``(seed, layer index)``, so every process, and a single process building all
layers, starts from the same weights without holding the others. The rule is the
built-in models' (He-normal before a ReLU, Xavier-uniform otherwise, zero biases),
but the random stream is per layer, so the weights differ from `build_model`'s.

    layers = meta_layers("mlp:2048x2048", (1, 8, 8), 10)
    costs = traced_costs(layers, (1, 8, 8), rows=8)
    starts = balanced_starts(costs, 3)
    mine = materialize(layers, starts[1], starts[2], seed=0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from fedring.pipeline.cost import LayerCost, StageSplitError, layers_of
from fedring.training.models import build_model, mlp_widths


def meta_layers(spec: str, feature_shape: tuple[int, ...], num_classes: int) -> list[nn.Module]:
    """The layers of model `spec` with shapes but no storage (``meta`` tensors).

    ``mlp:W1xW2...`` is laid out here as `build_model` lays it out (Flatten, then Linear
    and ReLU per width, then the logits): running `build_model`'s initialisers on
    ``meta`` tensors loads PyTorch's meta kernels, about 70 MB of RSS. Other specs go
    through `build_model` and pay that."""
    with torch.device("meta"):
        if not spec.startswith("mlp:"):
            return layers_of(build_model(spec, feature_shape, num_classes, seed=0))
        layers: list[nn.Module] = [nn.Flatten()]
        fan_in = math.prod(feature_shape)
        for width in mlp_widths(spec):
            layers += [nn.Linear(fan_in, width), nn.ReLU()]
            fan_in = width
        return [*layers, nn.Linear(fan_in, num_classes)]


# Layers that keep a sample's shape. Shapes of these, Linear and Flatten are worked out
# here: a forward on `meta` tensors loads PyTorch's meta kernels, about 75 MB of RSS,
# a fifth of a Pi 3's budget.
_SHAPE_KEEPING = (nn.ReLU, nn.Tanh, nn.GELU, nn.Sigmoid, nn.Dropout, nn.Identity)


def _out_shape(layer: nn.Module, shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
    if isinstance(layer, _SHAPE_KEEPING):
        return shape
    if isinstance(layer, nn.Flatten) and layer.start_dim == 1 and layer.end_dim == -1:
        return (math.prod(shape),)
    if isinstance(layer, nn.Linear) and shape[-1] == layer.in_features:
        return (*shape[:-1], layer.out_features)
    out = layer(torch.empty((rows, *shape), device="meta"))  # any other layer: traced
    return tuple(out.shape[1:])


def traced_costs(
    layers: Sequence[nn.Module], feature_shape: tuple[int, ...], rows: int
) -> list[LayerCost]:
    """Each layer's parameters and output shape for a micro-batch of `rows` rows, from
    the layers' shapes alone; no time is measured (``seconds`` is 0), so every process
    plans the same."""
    shape, costs = tuple(feature_shape), []
    for i, layer in enumerate(layers):
        shape = _out_shape(layer, shape, rows)
        params = sum(p.numel() for p in layer.parameters())
        costs.append(LayerCost(i, type(layer).__name__, params, params * 4, shape,
                               rows * math.prod(shape) * 4, 0.0))  # fmt: skip
    return costs


def balanced_starts(costs: Sequence[LayerCost], stages: int) -> list[int]:
    """Cut points (layer where each stage starts) that minimise the largest stage's
    parameter count: deterministic, so processes that plan alone agree."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise StageSplitError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c.params)
    # best[k][j]: the smallest possible largest stage over layers [0, j) in k stages
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                worst = max(best[k - 1][i], prefix[j] - prefix[i])
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    starts, j = [], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return starts[::-1]


def materialize(layers: Sequence[nn.Module], start: int, end: int, seed: int) -> nn.Sequential:
    """Layers ``start .. end - 1`` with real storage, each initialised from
    ``(seed, its index)``; the other layers stay on ``meta``."""
    own = []
    for i in range(start, end):
        layer = layers[i].to_empty(device="cpu")
        if isinstance(layer, nn.Linear | nn.Conv1d | nn.Conv2d):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
            before_relu = i + 1 < len(layers) and isinstance(layers[i + 1], nn.ReLU)
            with torch.no_grad():
                if before_relu:
                    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu", generator=gen)
                else:
                    nn.init.xavier_uniform_(layer.weight, generator=gen)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)
        own.append(layer)
    return nn.Sequential(*own)

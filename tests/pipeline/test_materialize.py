"""Stage layers built alone: the same weights whichever stages a process builds, shapes
traced without storage, cuts balanced by parameter count."""

from __future__ import annotations

import pytest
import torch

from fedring.pipeline.cost import StageSplitError
from fedring.pipeline.materialize import balanced_starts, materialize, meta_layers, traced_costs
from fedring.training.models import build_model, params_sha256


def test_stages_built_apart_equal_the_whole_model_built_at_once() -> None:
    whole = materialize(meta_layers("mlp:32x16x8", (1, 8, 8), 10), 0, 8, seed=3)
    layers = meta_layers("mlp:32x16x8", (1, 8, 8), 10)
    parts = [materialize(layers, i, j, seed=3) for i, j in ((0, 3), (3, 5), (5, 8))]
    assert params_sha256(torch.nn.Sequential(*[m for p in parts for m in p])) == params_sha256(
        whole
    )
    other = materialize(meta_layers("mlp:32x16x8", (1, 8, 8), 10), 0, 8, seed=4)
    assert params_sha256(other) != params_sha256(whole)  # the seed matters


def test_meta_mlp_has_build_models_layout_and_traced_shapes_match_a_real_forward() -> None:
    built = build_model("mlp:32x16", (1, 8, 8), 10, seed=0)
    layers = meta_layers("mlp:32x16", (1, 8, 8), 10)
    assert [repr(a) for a in layers] == [repr(b) for b in built]
    costs = traced_costs(layers, (1, 8, 8), rows=4)
    x = torch.zeros(4, 1, 8, 8)
    for layer, cost in zip(built, costs, strict=True):
        x = layer(x)
        assert cost.out_shape == tuple(x.shape[1:])
        assert cost.activation_bytes == x.numel() * 4
        assert cost.params == sum(p.numel() for p in layer.parameters())


def test_balanced_starts_minimise_the_largest_stage() -> None:
    costs = traced_costs(meta_layers("mlp:512x512x512", (1, 8, 8), 10), (1, 8, 8), rows=1)
    # params per layer: 0, 33280, 0, 262656, 0, 262656, 0, 5130
    assert balanced_starts(costs, 2) == [0, 4]
    assert balanced_starts(costs, 3) == [0, 2, 4]
    with pytest.raises(StageSplitError, match="cannot cut 8 layers into 9"):
        balanced_starts(costs, 9)

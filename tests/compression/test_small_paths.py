"""The cheap paths for small vectors give the same bits as the general ones.

`GroupTopK` selects a range of at most one block in one batch of rows (the padded
last group included), and `SparseGroups.add_to` scatters into a [rows, G] view of
the output with the decoded values and int64 indices the compressor kept; all
exist to cut torch calls a round on small models. A model's hash
must not move for it, so both are compared bit for bit with the general paths:
the blocked selection (forced by a block of one row) and `index_add_` at flat
positions, over random sizes, group sizes, dtypes, ranges, ties and alphas.
"""

from __future__ import annotations

import random

import pytest
import torch

from fedring.compression import group_topk
from fedring.compression.group_topk import GroupTopK
from fedring.compression.sparse import SparseGroups, _scatter_add
from fedring.compression.values import decode_values

DTYPES = ("fp32", "fp16", "bf16", "int8", "sign")


def _case(rng: random.Random) -> tuple[torch.Tensor, GroupTopK, tuple[int, int] | None]:
    numel = rng.randint(1, 4000)
    g = rng.choice([4, 16, 64, 100, 256, 1000])
    topk = GroupTopK(g, rng.randint(1, min(g, 8)), rng.choice(DTYPES))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(numel, generator=gen) * rng.choice([1e-3, 1.0, 1e3])
    if rng.random() < 0.3:  # mostly zeros: ties at zero, as in ring accumulators
        x = torch.where(torch.rand(numel, generator=gen) < 0.9, torch.zeros(numel), x)
    if rng.random() < 0.2:
        x = torch.round(x)  # ties between non-zeros
    n = -(-numel // g)
    g0 = rng.randint(0, n - 1)
    return x, topk, None if rng.random() < 0.3 else (g0, rng.randint(g0, n))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def test_small_selection_matches_the_blocked_one(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(20261125)
    cases = [_case(rng) for _ in range(1500)]
    fast = [topk.compress(x, groups=groups) for x, topk, groups in cases]
    monkeypatch.setattr(group_topk, "_BLOCK_ENTRIES", 0)  # one row a block: the general path
    for (x, topk, groups), got in zip(cases, fast, strict=True):
        ref = topk.compress(x, groups=groups)
        assert _same(got.indices, ref.indices) and _same(got.values, ref.values)
        assert (got.scales is None) == (ref.scales is None)
        assert got.scales is None or ref.scales is None or _same(got.scales, ref.scales)


def _reference_add(p: SparseGroups, out: torch.Tensor, alpha: float) -> None:
    # decoded from the wire values, not what the compressor kept: the cache is checked too
    _scatter_add(out, p.positions(), decode_values(p.values, p.scales).reshape(-1), alpha)


@pytest.mark.parametrize("alpha", [1.0, -1.0, 0.37, -2.5])
def test_add_to_matches_index_add_at_flat_positions(alpha: float) -> None:
    rng = random.Random(7)
    for _ in range(600):
        x, topk, groups = _case(rng)
        p = topk.compress(x, groups=groups)
        base = torch.randn(x.numel(), generator=torch.Generator().manual_seed(rng.randrange(99)))
        got, ref = base.clone(), base.clone()
        p.add_to(got, alpha)
        _reference_add(p, ref, alpha)
        assert _same(got, ref)


def test_add_to_a_strided_output_takes_the_general_path() -> None:
    p = GroupTopK(4, 1).compress(torch.tensor([1.0, -5, 2, 0, 3, 0]))
    wide = torch.zeros(12)
    p.add_to(wide[::2])
    assert wide[::2].tolist() == [0.0, -5.0, 0.0, 0.0, 3.0, 0.0]


@pytest.mark.parametrize("scale", [1e-8, 1e-6, 6e-5, 1.0, 6e4, 1e6])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_numpy_compress_matches_the_torch_small_path(
    monkeypatch: pytest.MonkeyPatch, scale: float, dtype: str
) -> None:
    # fp16 subnormals (below 6.1e-5), overflow (above 65504, clamped), -0.0 and
    # exactify's zeroed entries all have to round in numpy as they do in torch
    rng = random.Random(int(scale * 1e9) % 9973)
    cases = []
    for _ in range(200):
        x, topk, groups = _case(rng)
        x = x * (scale if rng.random() < 0.5 else -scale)  # -scale: zeros become -0.0
        cases.append((x, GroupTopK(topk.group_size, topk.k, dtype), groups))  # type: ignore[arg-type]
    fast = [topk.compress(x, groups=groups) for x, topk, groups in cases]
    monkeypatch.setattr(group_topk, "numpy_view", lambda _: None)  # torch's _select_small
    for (x, topk, groups), got in zip(cases, fast, strict=True):
        ref = topk.compress(x, groups=groups)
        assert _same(got.indices, ref.indices) and _same(got.values, ref.values)
        assert got.decoded is not None and ref.decoded is not None
        assert _same(got.decoded, ref.decoded) and _same(got.wide_indices, ref.wide_indices)
        assert got.scales is None and ref.scales is None


def test_add_to_repeated_indices_adds_each_as_index_add_does() -> None:
    # a payload off the wire may repeat an index within a group; index_add_ adds both
    idx = torch.tensor([[1, 1, 3], [0, 2, 2]], dtype=torch.uint8)
    vals = torch.tensor([[0.1, 0.2, 0.3], [1e8, 1.0, -1e8]])
    p = SparseGroups(7, 4, 3, 0, idx, vals)
    for alpha in (1.0, -0.37):
        base = torch.randn(7, generator=torch.Generator().manual_seed(3))
        got, ref = base.clone(), base.clone()
        p.add_to(got, alpha)
        _reference_add(p, ref, alpha)
        assert _same(got, ref)


def test_add_to_a_tensor_that_needs_grad_takes_the_general_path() -> None:
    p = GroupTopK(4, 1).compress(torch.tensor([1.0, -5, 2, 0, 3, 0]))
    out = torch.zeros(6, requires_grad=True)
    with torch.no_grad():
        p.add_to(out)
    assert out.tolist() == [0.0, -5.0, 0.0, 0.0, 3.0, 0.0]

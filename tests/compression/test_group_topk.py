"""GroupTopK: exactly k per group, the true top-k, bit-exact residuals, wire round trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedring.collective.payloads import decode_payload
from fedring.compression import ErrorFeedback, GroupTopK, PayloadLimits, k_for
from fedring.compression.sparse import n_groups
from fedring.wire import pack_arrays
from tests.strategies import flat_vectors, value_dtypes

group_sizes = st.sampled_from([1, 2, 7, 64, 100, 256, 257, 1000, 4096, 65536])


def _topk(g: int, draw_k: st.DataObject, dtype: str) -> GroupTopK:
    return GroupTopK(g, draw_k.draw(st.integers(1, min(g, 12))), dtype)  # type: ignore[arg-type]


@given(x=flat_vectors(), g=group_sizes, data=st.data(), dtype=value_dtypes)
def test_exactly_k_distinct_entries_per_group(
    x: torch.Tensor, g: int, data: st.DataObject, dtype: str
) -> None:
    c = _topk(g, data, dtype).compress(x)
    assert c.indices.shape == (n_groups(x.numel(), g), c.k)
    assert c.values.shape == c.indices.shape
    idx = c.indices.to(torch.int64)
    assert bool((idx < g).all())
    for row in idx:  # distinct within every group
        assert row.unique().numel() == c.k


@given(x=flat_vectors(), g=group_sizes, data=st.data())
def test_selects_the_largest_magnitudes_of_each_group(
    x: torch.Tensor, g: int, data: st.DataObject
) -> None:
    c = _topk(g, data, "fp32").compress(x)
    padded = torch.cat([x, x.new_zeros(n_groups(x.numel(), g) * g - x.numel())]).view(-1, g)
    mags = padded.abs()
    real = torch.arange(n_groups(x.numel(), g) * g).view(-1, g) < x.numel()
    chosen = torch.zeros_like(real)
    chosen.scatter_(1, c.indices.to(torch.int64), True)
    smallest_chosen = torch.where(chosen & real, mags, torch.full_like(mags, float("inf"))).amin(1)
    largest_left = torch.where(~chosen & real, mags, torch.full_like(mags, -1.0)).amax(1)
    assert bool((smallest_chosen >= largest_left).all())


@given(x=flat_vectors(), g=group_sizes, data=st.data(), dtype=value_dtypes)
def test_decompress_plus_residual_is_bit_exact(
    x: torch.Tensor, g: int, data: st.DataObject, dtype: str
) -> None:
    ef = ErrorFeedback(x.numel())
    compensated = ef.compensate(x).clone()
    sent = _topk(g, data, dtype).compress(ef.residual)
    ef.update(sent)
    if dtype != "sign":
        assert torch.equal(sent.decompress() + ef.residual, compensated)
    else:  # +-scale cannot be zeroed where the residual rounds: one rounding at most
        sent_dense = sent.decompress()
        gap = (sent_dense + ef.residual - compensated).abs()
        bound = torch.finfo(torch.float32).eps * (compensated.abs() + sent_dense.abs())
        assert bool((gap <= bound).all())


@given(
    x=flat_vectors(max_numel=2000),
    g=st.sampled_from([3, 256, 300]),
    dtype=value_dtypes,
    data=st.data(),
)
def test_wire_round_trip_is_identical(
    x: torch.Tensor, g: int, dtype: str, data: st.DataObject
) -> None:
    c = _topk(g, data, dtype).compress(x)
    meta, arrays = c.to_wire()
    spec, body = pack_arrays(arrays)
    meta["arrays"] = spec
    back = decode_payload(meta, bytearray(body), PayloadLimits())
    assert torch.equal(back.decompress(), c.decompress())


@given(x=flat_vectors(), g=st.sampled_from([1, 5, 256]), data=st.data())
def test_a_range_of_groups_equals_that_part_of_the_whole(
    x: torch.Tensor, g: int, data: st.DataObject
) -> None:
    total = n_groups(x.numel(), g)
    g0 = data.draw(st.integers(0, total))
    g1 = data.draw(st.integers(g0, total))
    topk = GroupTopK(g, 1)
    part = topk.compress(x, groups=(g0, g1))
    whole = topk.compress(x)
    assert torch.equal(part.values, whole.values[g0:g1])
    assert torch.equal(part.indices, whole.indices[g0:g1])


def test_index_dtype_follows_group_size() -> None:
    x = torch.randn(70000)
    assert GroupTopK(256, 2).compress(x).indices.dtype == torch.uint8
    assert GroupTopK(257, 2).compress(x).indices.dtype == torch.uint16
    assert GroupTopK(65536, 1).compress(x).indices.dtype == torch.uint16


def test_k_from_density() -> None:
    assert k_for(0.01, 256) == 3 and k_for(0.01, 1024) == 10
    assert k_for(1e-6, 256) == 1  # at least one per group
    assert GroupTopK.from_density(1.0, 8).k == 8


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"group_size": 0}, "group_size"),
        ({"group_size": 70000}, "group_size"),
        ({"k": 0}, "k"),
        ({"group_size": 4, "k": 5}, "k"),
        ({"value_dtype": "fp8"}, "value dtype"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GroupTopK(**kwargs)


def test_fp16_overflow_stays_in_the_residual() -> None:
    x = torch.tensor([1e6, 1.0, -3e5, 2.0])
    ef = ErrorFeedback(4)
    g = ef.compensate(x).clone()
    sent = GroupTopK(2, 1, "fp16").compress(ef.residual)
    ef.update(sent)
    assert torch.equal(sent.decompress() + ef.residual, g)
    assert bool(torch.isfinite(sent.decompress()).all())


def test_sign_values_cost_one_bit_each_and_keep_the_group_mean_magnitude() -> None:
    x = torch.tensor([4.0, -2.0, 0.1, 0.0, -1.0, 3.0, 0.5, 0.0])
    c = GroupTopK(4, 2, "sign").compress(x)
    assert c.decompress().tolist() == [3.0, -3.0, 0.0, 0.0, -2.0, 2.0, 0.0, 0.0]
    assert c.wire_nbytes == 4 * 1 + 1 + 2 * 4  # indices, packed signs, scales

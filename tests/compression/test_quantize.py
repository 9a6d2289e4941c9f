"""Dense quantizers: error bounds, packed sizes, three-state signs, wire round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedring.collective.payloads import decode_payload
from fedring.compression import (
    DenseCodec,
    Int8Quantizer,
    PayloadLimits,
    SignBits,
    SignQuantizer,
    make_compressor,
)
from fedring.wire import pack_arrays
from tests.strategies import flat_vectors


def _round_trip(payload):  # type: ignore[no-untyped-def]
    meta, arrays = payload.to_wire()
    spec, body = pack_arrays(arrays)
    meta["arrays"] = spec
    return decode_payload(meta, bytearray(body), PayloadLimits())


@given(x=flat_vectors(), g=st.sampled_from([1, 7, 256, 5000]))
def test_int8_error_is_at_most_half_a_step_per_group(x: torch.Tensor, g: int) -> None:
    p = Int8Quantizer(g).compress(x)
    err = (p.decompress() - x).abs()
    steps = p.scales.repeat_interleave(g)[: x.numel()]  # each entry's group scale
    assert bool((err <= steps * 0.5 + 1e-6 * x.abs()).all())
    assert p.wire_nbytes == x.numel() + 4 * -(-x.numel() // g)
    assert torch.equal(_round_trip(p).decompress(), p.decompress())


@given(x=flat_vectors())
def test_fp16_and_bf16_relative_error(x: torch.Tensor) -> None:
    for dtype, tol in (("fp16", 2**-10), ("bf16", 2**-7)):
        p = DenseCodec(dtype).compress(x)  # type: ignore[arg-type]
        small = x.abs() < 6e-5  # below fp16's normal range the error is absolute
        err = (p.decompress() - x).abs()
        assert bool((err[~small] <= tol * x.abs()[~small]).all())
        assert torch.equal(_round_trip(p).decompress(), p.decompress())


@given(x=flat_vectors(), g=st.sampled_from([1, 8, 4096]))
def test_sign_keeps_signs_and_group_l1_mass(x: torch.Tensor, g: int) -> None:
    p = SignQuantizer(g).compress(x)
    out = p.decompress()
    assert p.positive.size == -(-x.numel() // 8)  # one bit per entry
    positive = x > 0
    assert bool((out[positive] >= 0).all()) and bool((out[~positive] <= 0).all())
    assert torch.allclose(out.abs().sum(), x.abs().sum(), rtol=1e-4, atol=1e-6)
    assert torch.equal(_round_trip(p).decompress(), out)


def test_three_state_signs_round_trip() -> None:
    s = torch.tensor([1, 0, -1, -1, 0, 1, 1, 0, -1], dtype=torch.int8)
    p = SignBits.from_signs(s, numel=20, start=5)
    assert torch.equal(p.signs(), s)
    assert torch.equal(_round_trip(p).signs(), s)
    assert p.decompress()[5:14].tolist() == s.float().tolist()


def test_registry_builds_every_compressor_and_refuses_unknown_names() -> None:
    x = torch.randn(1000)
    for name in ("none", "fp16", "bf16", "int8", "sign", "group-topk"):
        p = make_compressor(name).compress(x)
        assert p.decompress().shape == x.shape
    with pytest.raises(ValueError, match="'zstd' is not one of"):
        make_compressor("zstd")


def test_dense_codec_refuses_int8() -> None:
    with pytest.raises(ValueError, match="Int8Quantizer"):
        DenseCodec("int8")


def test_packed_bits_are_numpy_uint8() -> None:
    p = SignQuantizer(16).compress(torch.randn(33))
    assert p.positive.dtype == np.uint8 and p.positive.size == 5

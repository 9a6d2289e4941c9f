"""A star centre's reply (`engine.centre._down`): sparse where that is smaller, and
decoded by a member to the same bits as the dense reply of old."""

from __future__ import annotations

import torch

from fedring.compression.quantize import DenseChunk, DenseCodec
from fedring.compression.sparse import GroupSparse
from fedring.engine.centre import _down


def _bits(x: torch.Tensor) -> bytes:
    return x.numpy().tobytes()


def test_the_sum_of_sparse_updates_goes_sparse_and_decodes_to_the_dense_bits() -> None:
    g = torch.Generator().manual_seed(0)
    result = torch.zeros(10_000)
    at = torch.randperm(10_000, generator=g)[:400]
    result[at] = torch.randn(400, generator=g) * 1e-3
    codec = DenseCodec("fp16")
    down = _down(codec, result, 256)
    assert isinstance(down, GroupSparse)
    assert down.wire_nbytes * 5 < codec.compress(result).wire_nbytes  # 2 bytes an entry
    assert _bits(down.decompress()) == _bits(codec.compress(result).decompress())


def test_a_dense_result_stays_dense_and_a_negative_zero_decodes_alike() -> None:
    codec = DenseCodec("fp16")
    assert isinstance(_down(codec, torch.randn(1000), 256), DenseChunk)
    result = torch.zeros(1000)
    result[3], result[7] = -0.0, 1.0
    down = _down(codec, result, 256)
    assert isinstance(down, GroupSparse)
    assert _bits(down.decompress()) == _bits(codec.compress(result).decompress())

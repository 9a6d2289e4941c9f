"""The torch codec (CUDA and float64 buckets) against fedring's wire codec (CPU float32):
the same entries kept, the same bytes, the same mean, exact error feedback. CI has no
GPU, so the torch codec runs here on float64 CPU vectors, its code path on CUDA."""

import pytest
import torch

from fedring.compression.group_topk import GroupTopK
from fedring.compression.values import ValueDtype
from fedring.engine.ddp_codec import pack, working_dtype


@pytest.mark.parametrize("value_dtype", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("group_size", [256, 1024, 65536])  # uint8, int16, int16 >= 32768
def test_the_torch_codec_sends_and_decodes_what_the_wire_codec_does(
    value_dtype: ValueDtype, group_size: int
) -> None:
    gen = torch.Generator().manual_seed(group_size)
    ranks = [torch.randn(70_001, generator=gen) for _ in range(3)]  # a padded last group
    c = GroupTopK.from_density(0.01, group_size, value_dtype)
    wire = [pack(c, x) for x in ranks]
    torch_ = [pack(c, x.double()) for x in ranks]
    assert [p.blob.numel() for p in torch_] == [p.blob.numel() for p in wire]
    mean_wire = torch.empty(70_001)
    wire[0].mean_into([p.blob for p in wire], mean_wire)
    mean_torch = torch.empty(70_001, dtype=torch.float64)
    torch_[1].mean_into([p.blob for p in torch_], mean_torch)  # any rank's layout decodes
    assert torch.equal(mean_torch != 0, mean_wire != 0)  # the same entries kept
    assert torch.allclose(mean_torch.float(), mean_wire, rtol=1e-6, atol=0)


@pytest.mark.parametrize("value_dtype", ["fp32", "fp16", "bf16", "int8"])
def test_the_torch_codec_keeps_error_feedback_exact(value_dtype: ValueDtype) -> None:
    x = torch.randn(5_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    packed = pack(GroupTopK.from_density(0.05, 256, value_dtype), x)
    residual, sent = x.clone(), torch.empty_like(x)
    packed.subtract_sent(residual)
    packed.mean_into([packed.blob], sent)  # the mean over one rank is what it sent
    assert torch.equal(sent + residual, x)
    assert 0 < int(torch.count_nonzero(sent)) <= 20 * 13


def test_sign_values_are_refused_off_the_cpu_float32_path() -> None:
    with pytest.raises(TypeError, match="value_dtype='sign' needs CPU float32"):
        pack(GroupTopK.from_density(0.05, 256, "sign"), torch.randn(300, dtype=torch.float64))


def test_buckets_work_in_float32_or_float64() -> None:
    assert working_dtype(torch.bfloat16) == working_dtype(torch.float16) == torch.float32
    assert working_dtype(torch.float64) == torch.float64

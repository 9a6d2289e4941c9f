"""Hypothesis strategies shared by the compression and collective tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

value_dtypes = st.sampled_from(["fp32", "fp16", "bf16", "int8", "sign"])


@st.composite
def flat_vectors(draw: st.DrawFn, max_numel: int = 3000, dyadic: bool = False) -> torch.Tensor:
    """A flat float32 vector of awkward length, seeded, with some ties and zeros.

    `dyadic` values are small multiples of 1/8, so sums of a few of them are exact
    in fp32 (and fp16): conservation checks can then be bit for bit.
    """
    numel = draw(st.integers(1, max_numel))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if dyadic:
        return torch.randint(-64, 65, (numel,), generator=gen).to(torch.float32) / 8
    scale = draw(st.sampled_from([1e-6, 1.0, 1e3]))
    x = torch.randn(numel, generator=gen) * scale
    if draw(st.booleans()):
        x[torch.rand(numel, generator=gen) < 0.3] = 0.0  # zeros and exact ties
    return x

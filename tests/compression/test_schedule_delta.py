"""Density warm-up schedule and delta encoding against the last synced parameters."""

from __future__ import annotations

import pytest
import torch

from fedring.compression import DeltaEncoder, DensitySchedule, GroupTopK


def test_dgc_warmup_stages_then_target() -> None:
    s = DensitySchedule(target=0.001, steps_per_stage=5)
    seen = [s.density(step) for step in range(0, 30, 5)]
    assert seen == [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001]


def test_stages_below_target_are_skipped_and_zero_disables() -> None:
    assert DensitySchedule(target=0.1, steps_per_stage=2).density(2) == 0.1
    assert DensitySchedule(target=0.01).density(0) == 0.01


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target": 0.0},
        {"target": 1.5},
        {"target": 0.1, "steps_per_stage": -1},
        {"target": 0.1, "stages": (2.0,)},
    ],
)
def test_schedule_refuses_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DensitySchedule(**kwargs)


def test_delta_agents_agree_after_committing_the_same_update() -> None:
    start = torch.randn(500)
    a, b = DeltaEncoder(start), DeltaEncoder(start)
    local_a, local_b = start + 0.1 * torch.randn(500), start + 0.1 * torch.randn(500)
    topk = GroupTopK(50, 5)
    agreed = (
        topk.compress(a.delta(local_a)).decompress() + topk.compress(b.delta(local_b)).decompress()
    ) / 2
    a.commit_delta(agreed)
    b.commit_delta(agreed)
    assert a.digest() == b.digest()
    assert not torch.equal(a.reference, start)


def test_delta_refuses_other_shapes() -> None:
    d = DeltaEncoder(torch.zeros(4))
    with pytest.raises(ValueError, match="5 entries"):
        d.delta(torch.zeros(5))
    with pytest.raises(ValueError, match="does not fit"):
        d.load_state_dict({"reference": torch.zeros(3)})

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


def test_delta_is_the_change_since_the_reference_and_commit_moves_it() -> None:
    start = torch.randn(500)
    enc = DeltaEncoder(start)
    local = start + 0.1 * torch.randn(500)
    delta = enc.delta(local)
    assert torch.equal(delta, local - start)
    assert torch.equal(enc.reference, start)  # encoding does not move the reference
    sent = GroupTopK(50, 5).compress(delta).decompress()
    before = enc.digest()
    enc.commit_delta(sent)
    assert torch.equal(enc.reference, start + sent)
    assert enc.digest() != before


def test_agents_agree_iff_they_commit_the_same_delta() -> None:
    start = torch.randn(100)
    a, b, c = DeltaEncoder(start), DeltaEncoder(start), DeltaEncoder(start)
    agreed = torch.randn(100)
    a.commit_delta(agreed)
    b.commit_delta(agreed.clone())
    c.commit_delta(agreed + torch.finfo(torch.float32).eps)
    assert a.digest() == b.digest() != c.digest()
    restored = DeltaEncoder(torch.zeros(100))
    restored.load_state_dict(a.state_dict())
    assert restored.digest() == a.digest()


def test_delta_refuses_other_shapes() -> None:
    d = DeltaEncoder(torch.zeros(4))
    with pytest.raises(ValueError, match="5 entries"):
        d.delta(torch.zeros(5))
    with pytest.raises(ValueError, match="does not fit"):
        d.load_state_dict({"reference": torch.zeros(3)})

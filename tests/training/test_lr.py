"""LrSchedule: the three scalings, averaging switch, Goyal warm-up, field-naming errors."""

from __future__ import annotations

import itertools
import math

import pytest

from fedring.training.lr import LrSchedule


@pytest.mark.parametrize(
    ("scaling", "expected"),
    [("linear", 0.1 * 8 * 64 / 32), ("sqrt", 0.1 * math.sqrt(8 * 64 / 32)), ("none", 0.1)],
)
def test_peak_lr_for_each_scaling(scaling: str, expected: float) -> None:
    s = LrSchedule(base_lr=0.1, scaling=scaling, n_agents=8, batch_size=64, ref_batch=32)
    assert s.peak_lr == pytest.approx(expected)


@pytest.mark.parametrize("scaling", ["linear", "sqrt", "none"])
def test_not_averaged_keeps_base_lr(scaling: str) -> None:
    s = LrSchedule(base_lr=0.05, scaling=scaling, n_agents=8, averaged=False)
    assert s.peak_lr == 0.05
    assert s.lr_at(0) == s.lr_at(1000) == 0.05


def test_single_agent_at_reference_batch_is_unscaled() -> None:
    assert LrSchedule(base_lr=0.3).peak_lr == pytest.approx(0.3)


def test_warmup_ramps_linearly_from_base_to_peak() -> None:
    s = LrSchedule(base_lr=0.1, n_agents=5, warmup_steps=100)  # peak 0.5
    assert s.lr_at(0) == pytest.approx(0.1)
    assert s.lr_at(25) == pytest.approx(0.2)
    assert s.lr_at(50) == pytest.approx(0.3)
    assert s.lr_at(99) == pytest.approx(0.1 + 0.4 * 99 / 100)
    assert s.lr_at(100) == pytest.approx(0.5)
    assert s.lr_at(10_000) == pytest.approx(0.5)
    ramp = [s.lr_at(i) for i in range(101)]
    assert all(a < b for a, b in itertools.pairwise(ramp))


def test_no_warmup_starts_at_peak() -> None:
    s = LrSchedule(base_lr=0.1, n_agents=4)
    assert s.lr_at(0) == pytest.approx(0.4)


def test_negative_step_is_rejected() -> None:
    with pytest.raises(ValueError, match="step=-1"):
        LrSchedule(base_lr=0.1).lr_at(-1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("base_lr", 0.0),
        ("base_lr", -0.1),
        ("base_lr", math.nan),
        ("scaling", "cubic"),
        ("n_agents", 0),
        ("batch_size", 0),
        ("ref_batch", 0),
        ("warmup_steps", -1),
    ],
)
def test_validation_error_names_field_and_value(field: str, value: object) -> None:
    kwargs: dict[str, object] = {"base_lr": 0.1, field: value}
    with pytest.raises(ValueError, match=rf"^{field}={value!r}|^{field}={value}"):
        LrSchedule(**kwargs)  # type: ignore[arg-type]


def test_schedule_is_frozen() -> None:
    s = LrSchedule(base_lr=0.1)
    with pytest.raises(AttributeError):
        s.base_lr = 0.2  # type: ignore[misc]

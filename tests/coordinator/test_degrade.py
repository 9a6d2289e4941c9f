"""When a breaking ring goes asynchronous and when it comes back (`coordinator.degrade`;
the broker-level run: tests/mqtt/test_degrade.py)."""

from __future__ import annotations

from fedring.config import JobSpec
from fedring.coordinator.degrade import Degrade

SPEC = JobSpec(agents=4, degrade_after=3, degrade_window=50, degrade_window_s=0.0,
               degrade_calm=20, rounds=500)  # fmt: skip


def test_the_third_break_within_the_window_degrades_and_says_why() -> None:
    d = Degrade(SPEC)
    assert d.broke(10) == d.broke(40) == "" and not d.active
    why = d.broke(90)
    assert d.active and d.times == 1 and d.breaks == []
    assert "rounds [10, 40, 90]" in why and "going on asynchronously" in why
    assert d.broke(95) == ""  # already asynchronous


def test_breaks_at_one_round_are_one_failure() -> None:
    """One kill -9 can end three epochs at the same round (each survivor reports it
    before the broker's will arrives): that is one break, not three."""
    d = Degrade(SPEC)
    for at in (6, 6, 6, 30, 30):
        d.broke(at)
    assert not d.active and d.breaks == [6, 30]
    assert d.broke(31) and d.active


def test_a_calm_stretch_between_breaks_starts_the_count_again() -> None:
    d = Degrade(SPEC)
    for at in (10, 40, 91, 120):  # 91 - 40 > 50: the count restarts at 91
        d.broke(at)
    assert not d.active and d.breaks == [91, 120]


def test_calm_versions_end_the_asynchronous_epoch_once() -> None:
    d = Degrade(SPEC)
    for at in (1, 2, 3):
        d.broke(at)
    assert not d.calm(22)  # 19 versions since the break at 3
    d.moved(22)  # an agent came back: calm starts again
    assert not d.calm(41) and d.calm(42) and not d.calm(43)  # once
    assert "back to the ring from round 42" in d.back(42) and not d.active
    assert not d.calm(500)


def test_off_or_not_a_ring_never_degrades() -> None:
    for fields in ({"degrade_after": 0}, {"topology": "star"}, {"sync": "async"}):
        d = Degrade(SPEC.replace(**fields))
        for at in (1, 2, 3, 4, 5):  # five distinct rounds
            d.broke(at)
        assert not d.active, fields


def test_breaks_within_the_seconds_window_degrade_however_many_rounds_apart() -> None:
    """A fast ring whose boards take ~10 s to restart breaks ~90 rounds apart: more
    than `degrade_window` rounds, but within `degrade_window_s` seconds."""
    d = Degrade(SPEC.replace(degrade_window_s=120.0))
    assert d.broke(90, now=1000.0) == d.broke(180, now=1030.0) == ""
    why = d.broke(270, now=1061.0)
    assert d.active and "50 rounds or 120 s" in why


def test_breaks_far_apart_in_rounds_and_seconds_start_the_count_again() -> None:
    d = Degrade(SPEC.replace(degrade_window_s=120.0))
    d.broke(90, now=0.0)
    d.broke(180, now=200.0)  # 90 rounds and 200 s after: a new count
    assert d.breaks == [180] and not d.active

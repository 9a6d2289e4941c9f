"""When a breaking ring goes asynchronous: `degrade_after` re-formations, each within
`degrade_window` rounds of the one before (the broker-level run: tests/mqtt/test_degrade.py)."""

from __future__ import annotations

from pathlib import Path

from fedring.config import JobSpec
from fedring.coordinator.service import Coordinator, Options
from fedring.transport.mqtt import BrokerConfig


def _coordinator(tmp_path: Path, **fields: object) -> Coordinator:
    spec = JobSpec(agents=4, degrade_after=3, degrade_window=50).replace(**fields)
    return Coordinator(spec, BrokerConfig.parse("mqtt://127.0.0.1:1"), Options(out=tmp_path))


def test_the_third_break_within_the_window_degrades_and_says_so(tmp_path: Path) -> None:
    c = _coordinator(tmp_path)
    for at in (10, 40):
        c._note_break(at)
    assert not c.degraded and not c.asynchronous
    c._note_break(90)
    assert c.degraded and c.asynchronous and c.degradations == 1
    assert c.counters.snapshot()["degraded_to_async"] == 1
    assert "rounds [10, 40, 90]" in c.events[-1]["why"]
    assert "going on asynchronously" in c.events[-1]["why"]


def test_breaks_at_one_round_are_one_failure(tmp_path: Path) -> None:
    """One kill -9 can end three epochs at the same round (each survivor reports it
    before the broker's will arrives): that is one break, not three."""
    c = _coordinator(tmp_path)
    for at in (6, 6, 6, 30, 30):
        c._note_break(at)
    assert not c.degraded and c.breaks == [6, 30]
    c._note_break(31)
    assert c.degraded


def test_a_calm_stretch_between_breaks_starts_the_count_again(tmp_path: Path) -> None:
    c = _coordinator(tmp_path)
    for at in (10, 40, 91, 120):  # 91 - 40 > 50: the count restarts at 91
        c._note_break(at)
    assert not c.degraded and c.breaks == [91, 120]


def test_off_or_not_a_ring_never_degrades(tmp_path: Path) -> None:
    for fields in ({"degrade_after": 0}, {"topology": "star"}, {"sync": "async"}):
        c = _coordinator(tmp_path, **fields)
        for at in (1, 2, 3, 4, 5):  # five distinct rounds
            c._note_break(at)
        assert not c.degraded, fields

"""Schedules: every micro-batch once each way, bounded memory, and the bubble."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedring.pipeline.schedule import SCHEDULES, in_flight, ops, timeline


@given(st.sampled_from(SCHEDULES), st.integers(1, 6), st.integers(1, 9), st.data())
def test_each_micro_batch_runs_forward_then_backward_once(
    schedule: str, stages: int, m: int, data: st.DataObject
) -> None:
    stage = data.draw(st.integers(0, stages - 1))
    seq = [str(op) for op in ops(schedule, stages=stages, micro_batches=m, stage=stage)]
    assert sorted(seq) == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    assert all(seq.index(f"F{i}") < seq.index(f"B{i}") for i in range(m))
    assert [s for s in seq if s[0] == "B"] == [f"B{i}" for i in range(m)]  # accumulation order
    held = in_flight(schedule, stages, m, stage)
    assert held == (m if schedule == "gpipe" else min(m, stages - stage))


@given(st.sampled_from(SCHEDULES), st.integers(1, 6), st.integers(1, 9))
def test_equal_stages_leave_the_textbook_bubble(schedule: str, stages: int, m: int) -> None:
    t = timeline(schedule, [1.0] * stages, [2.0] * stages, micro_batches=m)
    assert t.makespan_s == pytest.approx((m + stages - 1) * 3.0)
    assert t.bubble == pytest.approx((stages - 1) / (m + stages - 1))


def test_a_slow_stage_and_transfers_lengthen_the_step() -> None:
    even = timeline("1f1b", [1.0, 1.0], [1.0, 1.0], micro_batches=4)
    slow = timeline("1f1b", [1.0, 3.0], [1.0, 3.0], micro_batches=4)
    hops = timeline("1f1b", [1.0, 1.0], [1.0, 1.0], micro_batches=4, hop_s=0.5)
    assert slow.makespan_s > even.makespan_s and slow.bubble > even.bubble
    # at least one hop each way on the critical path; 1F1B's steady state waits on more
    assert hops.makespan_s == pytest.approx(12.0) and even.makespan_s == pytest.approx(10.0)
    gpipe = timeline("gpipe", [1.0, 1.0], [1.0, 1.0], micro_batches=4, hop_s=0.5)
    assert gpipe.makespan_s == pytest.approx(10.0 + 2 * 0.5)


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="'zigzag' is not one of gpipe, 1f1b"):
        ops("zigzag", stages=2, micro_batches=2, stage=0)

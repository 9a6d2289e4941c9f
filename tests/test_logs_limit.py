"""LogLimiter: full lines first, then one summary per interval, bounded over all peers."""

from __future__ import annotations

import logging

import pytest

from fedring.logs_limit import LogLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_burst_then_one_summary_per_interval(caplog: pytest.LogCaptureFixture,
                                             clock: Clock) -> None:  # fmt: skip
    limiter = LogLimiter(logging.getLogger("t.limit"), "refused frames", burst=3,
                         interval_s=10.0, clock=clock)  # fmt: skip
    with caplog.at_level(logging.WARNING, "t.limit"):
        for i in range(500):
            clock.now = i * 0.05  # 25 s of refusals
            limiter.warning("x", "bad_mac", "refused %d from %s", i, "x")
    got = lines(caplog)
    assert got[:3] == ["refused 0 from x", "refused 1 from x", "refused 2 from x"]
    summaries = got[3:]
    assert len(summaries) == 2  # at 10 s and at 20 s after the burst
    assert summaries[0] == "200 more refused frames from 'x' (bad_mac) in the last 10 s"
    assert summaries[1].startswith("200 more refused frames from 'x' (bad_mac)")


def test_pairs_are_limited_apart(caplog: pytest.LogCaptureFixture, clock: Clock) -> None:
    limiter = LogLimiter(logging.getLogger("t.limit"), "refusals", burst=2, clock=clock)
    with caplog.at_level(logging.WARNING, "t.limit"):
        for _ in range(10):
            limiter.warning("x", "bad_mac", "x bad_mac")
            limiter.warning("x", "too_large", "x too_large")
            limiter.warning("y", "bad_mac", "y bad_mac")
    assert sorted(lines(caplog)) == sorted(["x bad_mac", "x too_large", "y bad_mac"] * 2)


def test_a_quiet_pair_reports_what_it_held_then_logs_in_full(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    limiter = LogLimiter(logging.getLogger("t.limit"), "refusals", burst=1, interval_s=5.0,
                         clock=clock)  # fmt: skip
    with caplog.at_level(logging.WARNING, "t.limit"):
        for _ in range(4):
            limiter.warning("x", "bad", "first storm")
        clock.now = 60.0
        limiter.warning("x", "bad", "second storm")
    assert lines(caplog) == ["first storm", "3 more refusals from 'x' (bad) in the last 0 s",
                             "second storm"]  # fmt: skip


def test_made_up_peer_names_cannot_flood(caplog: pytest.LogCaptureFixture,
                                         clock: Clock) -> None:  # fmt: skip
    limiter = LogLimiter(logging.getLogger("t.limit"), "refusals", burst=5, interval_s=10.0,
                         max_keys=16, max_lines=20, clock=clock)  # fmt: skip
    with caplog.at_level(logging.WARNING, "t.limit"):
        for i in range(5001):
            clock.now = i * 0.002  # 10 s, then one event in the next interval
            limiter.warning(f"peer{i}", "bad", "from peer%d", i)
    got = lines(caplog)
    assert len(got) == 22
    assert got[20] == "4980 more refusals (over the limit of 20 lines) in the last 10 s"
    assert got[21] == "from peer5000"
    assert len(limiter._pairs) == 16

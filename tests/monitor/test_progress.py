"""The progress line: on stderr, at least every 2 s while a job runs, never on stdout."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedring.monitor import JobFeed
from fedring.monitor.progress import ProgressLine, line
from tests.monitor.conftest import MISSING
from tests.mqtt.conftest import Fleet, _env, job_toml

ROUND = re.compile(r"round (\d+)/(\d+)")


def _read_stderr(proc: subprocess.Popen[bytes]) -> list[tuple[float, str]]:
    """Each stderr line with the moment it arrived (read while the process runs)."""
    lines: list[tuple[float, str]] = []

    def pump() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            lines.append((time.monotonic(), raw.decode(errors="replace").rstrip()))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    proc.wait(300)
    reader.join(5)
    return lines


def _progress_gaps(lines: list[tuple[float, str]]) -> tuple[list[int], float]:
    """The rounds the progress lines showed, and the longest gap between two of them
    while the rounds ran (from the first round's line to the last round's)."""
    stamped = [(t, int(m.group(1))) for t, text in lines if (m := ROUND.search(text))]
    assert stamped, "no progress line on stderr"
    last = max(r for _, r in stamped)
    running = [t for t, r in stamped if r < last] + [next(t for t, r in stamped if r == last)]
    gaps = [b - a for a, b in itertools.pairwise(running)]
    return [r for _, r in stamped], max(gaps, default=0.0)


def test_simulate_shows_progress_on_stderr_and_keeps_stdout_json() -> None:
    args = [sys.executable, "-m", "fedring", "simulate", "--agents", "4", "--dataset",
            "digits", "--rounds", "300", "--json"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert proc.stdout is not None
    out = proc.stdout.read()
    lines = _read_stderr(proc)
    assert proc.returncode == 0, lines
    json.loads(out)  # stdout is the one summary object, nothing else
    rounds, gap = _progress_gaps(lines)
    assert rounds == sorted(rounds) and rounds[-1] == 300, rounds
    assert len(set(rounds)) >= 2, f"one progress line for 300 rounds: {rounds}"
    assert gap <= 2.0, f"the progress line stood still for {gap:.1f} s"


def test_quiet_prints_no_progress() -> None:
    args = [sys.executable, "-m", "fedring", "simulate", "--agents", "2", "--dataset",
            "digits", "--rounds", "30", "--json", "--quiet"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, env=_env(), timeout=120)
    assert done.returncode == 0
    assert not ROUND.search(done.stderr.decode()), done.stderr.decode()[-500:]


@pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")
def test_coordinator_progress_updates_every_2_s(fleet: Fleet, tmp_path: Path) -> None:
    job = job_toml(tmp_path, rounds=300, compression="group-topk", density=0.01)
    args = [sys.executable, "-m", "fedring", "coordinator", "run", str(job), "--broker",
            fleet.url, "--out", str(tmp_path / "out"), "--json", "--no-onnx"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        out = proc.stdout.read()
        lines = _read_stderr(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, [text for _, text in lines][-20:]
    summary = json.loads(out)
    rounds, gap = _progress_gaps(lines)
    assert rounds[-1] == summary["rounds"] == 300, rounds
    assert gap <= 2.0, f"the progress line stood still for {gap:.1f} s"
    texts = [text for _, text in lines if ROUND.search(text)]
    assert "members 4/4 ring" in texts[-1] and "sent " in texts[-1], texts[-1]


def test_while_enrolling_a_pipe_shows_the_agents_online() -> None:
    """Before the first round the line counts the agents online out of those wanted."""
    feed = JobFeed(job="j", rounds=10, agents=4)
    read, write = _pipe()
    with ProgressLine(feed, stream=write):
        feed.online(2)
        time.sleep(1.5)
    write.close()
    text = read.read()
    assert "waiting for agents 2/4" in text, text


def _pipe():  # type: ignore[no-untyped-def]
    import os

    r, w = os.pipe()
    return open(r), open(w, "w")


def test_the_line_names_a_reformation() -> None:
    feed = JobFeed(job="j", rounds=10, agents=3)
    feed.members(["a0", "a1", "a2"], "ring")
    feed.round({"round": 3, "loss": 1.0, "bytes_sent": 10})
    feed.event("re-formed", "a2 lost")
    assert line(feed.snapshot()).endswith("| re-formed: a2 lost")

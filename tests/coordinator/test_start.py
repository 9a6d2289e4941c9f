"""A coordinator's start: its output folder's lock, and a broker that is not there.

No broker is started here: a refused connection and a port that never answers are
enough, and both must end the coordinator quickly with exit code 1 and a message
that says what is wrong (issue 27).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedring.cli import app
from fedring.coordinator.lease import CoordinatorBusy, lock_folder
from fedring.transport.mosquitto import free_port

JOB = '[job]\nagents = 2\ndataset = "digits"\nrounds = 3\n'


def _job(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    return path


def _run(tmp_path: Path, url: str, *extra: str) -> tuple[int, str, float]:
    args = ["coordinator", "run", str(_job(tmp_path)), "--broker", url,
            "--out", str(tmp_path / "out"), *extra]  # fmt: skip
    started = time.monotonic()
    result = CliRunner().invoke(app, args)
    return result.exit_code, " ".join(result.output.split()), time.monotonic() - started


@pytest.mark.parametrize("user", ["", "coordinator"])  # with a user name, nothing peeks first
def test_a_refused_connection_fails_at_once(tmp_path: Path, user: str) -> None:
    code, text, took = _run(tmp_path, f"mqtt://127.0.0.1:{free_port()}", "--username", user)
    assert code == 1, text
    assert "refused" in text.lower() and "Traceback" not in text, text
    assert took < 5  # not the 15 s connect timeout


@pytest.fixture()
def mute_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a wrong service, a stuck broker)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def test_the_broker_wait_is_bounded_by_enrol_timeout(tmp_path: Path, mute_port: int) -> None:
    code, text, took = _run(tmp_path, f"mqtt://127.0.0.1:{mute_port}", "--username",
                            "coordinator", "--enrol-timeout", "2")  # fmt: skip
    assert code == 1 and "no answer from broker" in text, text
    assert took < 8  # within the 2 s asked (and the import), not the fixed 15 s


def _hold(out: str, ready: Any, done: Any) -> None:
    lock = lock_folder(Path(out))
    ready.set()
    done.wait(30)
    lock.release()


def test_the_folder_lock_names_its_holder_and_is_released_with_it(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready, done))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(CoordinatorBusy, match=rf"{tmp_path} is in use .*pid {holder.pid}\)"):
            lock_folder(tmp_path)
    finally:
        done.set()
        holder.join(30)
    with lock_folder(tmp_path) as lock:  # the holder is gone: free again
        assert (tmp_path / ".coordinator.lock").read_text().strip() == str(os.getpid())
        assert lock.fd >= 0


@pytest.mark.parametrize("sample", ["7", "5"])
def test_a_sample_larger_than_the_fleet_is_refused_naming_the_field(
    tmp_path: Path, sample: str
) -> None:
    """`sample = 7` of 4 agents would train all 4 every round, silently (issue 27)."""
    job = _job(tmp_path)
    job.write_text(JOB.replace("agents = 2", "agents = 4") + 'topology = "star"\n'
                   f"sample = {sample}\n")  # fmt: skip
    result = CliRunner().invoke(app, ["coordinator", "run", str(job), "--broker",
                                      f"mqtt://127.0.0.1:{free_port()}"])  # fmt: skip
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert f"field 'sample'={sample}" in text and "agents=4" in text, text


def test_a_sample_within_the_fleet_is_taken(tmp_path: Path) -> None:
    from fedring.config import JobSpec

    job = _job(tmp_path)
    job.write_text(JOB.replace("agents = 2", "agents = 4") + 'topology = "star"\nsample = 4\n')
    assert JobSpec.from_toml(job).sample == 4

"""A real Mosquitto on loopback, agent daemons as processes, the coordinator as a process.

Everything a test starts it stops by PID, including on failure. Tests here are
skipped (with the reason) only where `mosquitto` is not installed; CI installs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fedring.transport.mosquitto import Mosquitto, MosquittoMissing, mosquitto_binary

try:
    mosquitto_binary()
    MISSING = ""
except MosquittoMissing as exc:
    MISSING = str(exc)

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

JOB = """[job]
agents = {agents}
dataset = "digits"
compression = "group-topk"
density = 0.01
rounds = {rounds}
eval_every = 10
target_accuracy = {target}
seed = 0
timeout_s = 20.0
"""


def job_file(tmp: Path, agents: int = 4, rounds: int = 600, target: float = 0.95) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "job.toml"
    path.write_text(JOB.format(agents=agents, rounds=rounds, target=target))
    return path


def job_toml(tmp: Path, **fields: object) -> Path:
    """`tmp`/job.toml: 4 agents on digits, seed 0, a 20 s step deadline, then `fields`."""
    tmp.mkdir(parents=True, exist_ok=True)
    job = {"agents": 4, "dataset": "digits", "eval_every": 10, "seed": 0, "timeout_s": 20.0}
    lines = [f"{k} = {json.dumps(v)}" for k, v in {**job, **fields}.items()]
    path = tmp / "job.toml"
    path.write_text("\n".join(["[job]", *lines, ""]))
    return path


def checkpoint_round(out: Path) -> int:
    """The round of the coordinator's checkpoint in `out` (-1: none yet)."""
    from fedring.coordinator.checkpoint import Checkpoint

    return Checkpoint.load(out).round if (out / "checkpoint.pt").exists() else -1


def started(url: str, job: Path, out: Path, round: int) -> subprocess.Popen[bytes]:
    """A coordinator process for `job`, once it has checkpointed `round`."""
    proc = coordinator(url, job, out)
    wait_for(lambda: checkpoint_round(out) >= round, 90, f"round {round}")
    return proc


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Fleet:
    """Agent daemons, one process each, logging to files under `logs`."""

    def __init__(
        self, url: str, logs: Path, extra: dict[str, list[str]] | None = None,
        env: dict[str, dict[str, str]] | None = None,
    ) -> None:  # fmt: skip
        self.url, self.logs = url, logs
        self.extra = extra or {}
        self.env = env or {}  # an agent's extra environment variables
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, agent: str) -> None:
        args = [sys.executable, "-m", "fedring", "-v", "agent", "--broker", self.url, "--id", agent]
        log = open(self.logs / f"{agent}.log", "ab")  # noqa: SIM115 - owned by the process
        self.procs[agent] = subprocess.Popen(
            args + self.extra.get(agent, []), stdout=log, stderr=log,
            env={**_env(), **self.env.get(agent, {})},
            start_new_session=True,
        )  # fmt: skip
        log.close()

    def kill(self, agent: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[agent]
        proc.send_signal(sig)
        proc.wait(30)

    def log(self, agent: str) -> str:
        return (self.logs / f"{agent}.log").read_text(errors="replace")

    def stop(self) -> dict[str, int]:
        """SIGTERM every daemon; return their exit codes (0 = clean)."""
        codes = {}
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for agent, proc in self.procs.items():
            try:
                codes[agent] = proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[agent] = proc.wait(5)
        return codes


def coordinator(
    url: str, job: Path, out: Path, *extra: str, user: str = "", onnx: bool = False
) -> subprocess.Popen[bytes]:
    """A coordinator process for `job`. The ONNX export at the end (some 2-4 s of CPU a
    job) only where the test asks for it (`onnx=True`) and checks it."""
    args = [sys.executable, "-m", "fedring", "-v", "coordinator", "run", str(job),
            "--broker", url, "--out", str(out), "--json", "--username", user,
            "--onnx" if onnx else "--no-onnx", *extra]  # fmt: skip
    err = open(out.parent / f"{out.name}-coordinator.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=err, env=_env(), start_new_session=True
    )
    err.close()
    return proc


def finish(proc: subprocess.Popen[bytes], timeout: float = 240.0) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, f"coordinator exited {proc.returncode}"
    return json.loads(out)


def finish_after(proc: subprocess.Popen[bytes], action: Callable[[], object],
                 timeout: float = 240.0) -> dict:  # fmt: skip
    """`action` (kill a member, say) while the coordinator runs, then its summary; the
    coordinator is killed if either fails."""
    try:
        action()
        return finish(proc, timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(persistence=True, workdir=tmp_path_factory.mktemp("broker")) as b:
        yield b


@pytest.fixture(scope="module")
def fleet(broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Four daemons that serve every job of a test module, one after the other."""
    f = Fleet(broker.url, tmp_path_factory.mktemp("logs"))
    for i in range(4):
        f.start(f"a{i}")
    yield f
    f.stop()

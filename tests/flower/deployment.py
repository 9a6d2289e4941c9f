"""A SuperLink and SuperNodes on loopback for tests, each in its own session, stopped by PID.

Every process is started with ``start_new_session=True``, so its session id is its
PID and everything it spawns (SuperExec, ServerApp and ClientApp processes) can be
found and ended with it. `Deployment.stop` ends the sessions (SIGTERM, then
SIGKILL) and `leftovers` lists any process still in one of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedring.bench.sessions import free_port, session_members, stop_session
from fedring.flower.simulation import QUIET_ENV

BIN = Path(sys.executable).parent
CONNECTION = "fedring-test"


def wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:.0f} s")


class Deployment:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "flwr-home"
        self.home.mkdir(parents=True)
        self.port = free_port()
        self.env = {**os.environ, **QUIET_ENV, "FLWR_HOME": str(self.home),
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True, cwd=self.root)  # fmt: skip
        log.close()
        self.procs[name] = proc
        return proc

    def start(self, supernodes: int) -> None:
        self._start("superlink", [str(BIN / "flower-superlink"), "--insecure", "--host",
                                  "127.0.0.1", "--port", str(self.port),
                                  "--disable-runtime-dependency-installation"])  # fmt: skip
        wait_port(self.port, 60)
        for i in range(supernodes):
            self._start(f"supernode-{i}", [
                str(BIN / "flower-supernode"), "--insecure",
                "--superlink", f"127.0.0.1:{self.port}", "--port", str(free_port()),
                "--node-config", f"partition-id={i} num-partitions={supernodes}",
            ])  # fmt: skip

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def flwr(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "flwr"), *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout_s, cwd=self.root)  # fmt: skip

    def run_app(self, app: Path, run_config: str) -> str:
        """`flwr run`; returns the run id (the exit code says nothing about the run)."""
        r = self.flwr("run", str(app), CONNECTION, "--run-config", run_config, "--format",
                      "json")  # fmt: skip
        try:
            return str(json.loads(r.stdout)["run-id"])
        except (ValueError, KeyError):
            raise AssertionError(f"flwr run did not start a run:\n{r.stdout}\n{r.stderr}") from None

    def run_status(self, run_id: str) -> dict[str, Any]:
        r = self.flwr("ls", CONNECTION, "--format", "json")
        runs = json.loads(r.stdout)["runs"]
        return next(run for run in runs if str(run["run-id"]) == run_id)

    def wait_finished(self, run_id: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.run_status(run_id)
            if str(run["status"]).startswith("finished"):
                return run
            time.sleep(2)
        raise TimeoutError(f"run {run_id} not finished after {timeout_s:.0f} s: {run['status']}")

    def kill(self, name: str) -> None:
        """SIGKILL a process's whole session: a board losing power."""
        stop_session(self.procs[name].pid, kill_first=True)
        self.procs[name].wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_session(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def leftovers(self) -> list[int]:
        return [pid for p in self.procs.values() for pid in session_members(p.pid)]


__all__ = ["CONNECTION", "Deployment", "free_port", "session_members", "wait_port"]

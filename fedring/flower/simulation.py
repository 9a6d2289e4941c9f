"""Run a fedring job on Flower's simulation engine, in a child process with a deadline.

Ray hangs forever when a client asks for more CPUs than exist, and a stuck actor
never returns, so the engine runs in its own process session: the parent waits
up to `timeout_s`, then ends the whole session (SIGTERM, then SIGKILL) and
reports a timeout. Each simulated client asks for 1 CPU and Ray is told how
many the machine has, so at most that many clients train at once.

    python -m fedring.flower.simulation JOB.json OUT_DIR     # what `simulate` runs
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedring.config import JobSpec
from fedring.flower.job import FlowerJob

QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keeps Ray on 127.0.0.1
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_DEDUP_LOGS": "0",
}


class SimulationError(RuntimeError):
    """The simulation failed or ran past its deadline; the message says which."""


def backend_config(cpus: int) -> dict[str, Any]:
    """One CPU per client and `cpus` in all: never more than the machine has."""
    return {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": cpus, "num_gpus": 0, "include_dashboard": False},
    }


def job_to_json(job: FlowerJob) -> str:
    return json.dumps({"spec": job.spec.resolved(), "downlink": job.downlink,
                       "round_timeout_s": job.round_timeout_s,
                       "server_momentum": job.server_momentum})  # fmt: skip


def job_from_json(text: str) -> FlowerJob:
    d = json.loads(text)
    return FlowerJob(JobSpec.from_mapping(d["spec"]), d["downlink"], d["round_timeout_s"],
                     d["server_momentum"])  # fmt: skip


def run_in_process(job: FlowerJob, out: Path, cpus: int) -> None:
    """Run the engine here (the child's side); the summary goes to ``out/summary.json``."""
    os.environ.update(QUIET_ENV)
    from flwr.simulation import run_simulation

    from fedring.flower.client_app import app as client_app
    from fedring.flower.server_app import make_server_app

    run_simulation(
        server_app=make_server_app(job, out=out),
        client_app=client_app,
        num_supernodes=job.spec.agents,
        backend_config=backend_config(cpus),
    )


def simulate(job: FlowerJob, out: Path, timeout_s: float = 900.0,
             cpus: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Run `job` in a child process; return its summary or raise `SimulationError`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(job_to_json(job))
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)
    cpus = cpus or os.cpu_count() or 1
    log = (out / "flower.log").open("wb")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedring.flower.simulation", str(out / "job.json"), str(out),
         str(cpus)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **QUIET_ENV},
    )  # fmt: skip
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_session(proc)
        raise SimulationError(
            f"the Flower simulation ran past --timeout {timeout_s:.0f} s and was stopped "
            f"(log: {out / 'flower.log'})"
        ) from None
    finally:
        log.close()
        stop_session(proc)  # Ray's helpers, should any outlive the engine
    if not summary_path.exists():
        raise SimulationError(
            f"the Flower simulation exited with {proc.returncode} and no summary; "
            f"last log lines:\n{_tail(out / 'flower.log')}"
        )
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    summary["engine_seconds"] = time.perf_counter() - start
    return summary


def stop_session(proc: subprocess.Popen[bytes]) -> None:
    """End every process in the child's session: SIGTERM, then SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.poll()
                return
            proc.poll()
            time.sleep(0.1)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


if __name__ == "__main__":
    job_path, out_dir, n_cpus = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    run_in_process(job_from_json(Path(job_path).read_text()), out_dir, n_cpus)

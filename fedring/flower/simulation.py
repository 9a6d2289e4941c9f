"""Run a fedring job on Flower's simulation engine, in a child process with a deadline.

Ray hangs forever when a client asks for more CPUs than exist, and a stuck actor
never returns, so the engine runs in its own process session: the parent waits
up to `timeout_s`, then ends the whole session (SIGTERM, then SIGKILL) and
reports a timeout. Each simulated client asks for 1 CPU and Ray is told how
many the machine has, so at most that many clients train at once.

    python -m fedring.flower.simulation job JOB.json OUT_DIR CPUS   # what `simulate` runs
    python -m fedring.flower.simulation apps MOD:SERVER MOD:CLIENT N CPUS
"""

from __future__ import annotations

import importlib
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
                       "server_momentum": job.server_momentum,
                       "enrol_timeout_s": job.enrol_timeout_s})  # fmt: skip


def job_from_json(text: str) -> FlowerJob:
    d = json.loads(text)
    return FlowerJob(JobSpec.from_mapping(d["spec"]), d["downlink"], d["round_timeout_s"],
                     d["server_momentum"], d["enrol_timeout_s"])  # fmt: skip


def run_in_process(job: FlowerJob, out: Path, cpus: int) -> None:
    """Run the engine here (the child's side); the summary goes to ``out/summary.json``."""
    from fedring.flower.client_app import app as client_app
    from fedring.flower.server_app import make_server_app

    _engine(make_server_app(job, out=out), client_app, job.spec.agents, cpus)


def _engine(server_app: Any, client_app: Any, n: int, cpus: int) -> None:
    os.environ.update(QUIET_ENV)
    from flwr.simulation import run_simulation

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=n,
        backend_config=backend_config(cpus),
    )


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def run_child(
    args: list[str], out: Path, timeout_s: float, env: dict[str, str] | None = None
) -> int:
    """``python -m fedring.flower.simulation ARGS`` in its own session, stopped at the
    deadline; its output goes to ``out/flower.log``. Returns the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "flower.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedring.flower.simulation", *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **QUIET_ENV, **(env or {})},
        )  # fmt: skip
        (out / "flower.pid").write_text(str(proc.pid))  # the session id of everything it starts
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SimulationError(
                f"the Flower simulation ran past its {timeout_s:.0f} s deadline and was stopped "
                f"(log: {out / 'flower.log'})"
            ) from None
        finally:
            stop_session(proc)  # the engine on a timeout; Ray's helpers should any outlive it


def simulate(job: FlowerJob, out: Path, timeout_s: float = 900.0,
             cpus: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Run `job` in a child process; return its summary or raise `SimulationError`."""
    (out / "summary.json").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(job_to_json(job))
    start = time.perf_counter()
    code = run_child(["job", str(out / "job.json"), str(out), str(cpus or os.cpu_count() or 1)],
                     out, timeout_s)  # fmt: skip
    summary = read_summary(out, code)
    summary["engine_seconds"] = time.perf_counter() - start
    return summary


def simulate_apps(
    server_ref: str, client_ref: str, n: int, out: Path, timeout_s: float = 900.0,
    cpus: int | None = None, env: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run any ServerApp / ClientApp pair ("module:attr") on the engine in a child process.

    The ServerApp writes its own ``summary.json`` into the directory named by the
    ``FEDRING_FLOWER_OUT`` environment variable (set here to `out`).
    """
    (out / "summary.json").unlink(missing_ok=True)
    args = ["apps", server_ref, client_ref, str(n), str(cpus or os.cpu_count() or 1)]
    code = run_child(args, out, timeout_s, {**(env or {}), "FEDRING_FLOWER_OUT": str(out)})
    return read_summary(out, code)


def read_summary(out: Path, code: int) -> dict[str, Any]:
    path = out / "summary.json"
    if not path.exists():
        raise SimulationError(
            f"the Flower simulation exited with {code} and no summary; "
            f"last log lines:\n{_tail(out / 'flower.log')}"
        )
    summary: dict[str, Any] = json.loads(path.read_text())
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
    if sys.argv[1] == "job":
        job_path, out_dir, n_cpus = sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
        run_in_process(job_from_json(Path(job_path).read_text()), out_dir, n_cpus)
    else:  # apps SERVER_REF CLIENT_REF N CPUS
        server_ref, client_ref, n, n_cpus = (
            sys.argv[2],
            sys.argv[3],
            int(sys.argv[4]),
            int(sys.argv[5]),
        )
        _engine(_load(server_ref), _load(client_ref), n, n_cpus)

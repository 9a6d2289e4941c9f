"""`Lab`: a shaped network (see `netns`), Mosquitto in its hub, and processes on nodes.

    with Lab(agents=4, bandwidth_mbps=10, workdir=Path("runs/lab")) as lab:
        lab.start_agents()
        result = lab.run_job(JobSpec(agents=4, rounds=200), timeout_s=600)

Every process is started with `launch(node, argv, log, env)` (the same contract as
`fedring.bench.launch`: the baselines start their servers and workers through it),
in its own session, and recorded by PID. Leaving the `with` block, normally, by an
exception, or by SIGTERM/SIGHUP (turned into `SystemExit` while the lab is open),
stops the recorded processes by PID, then ends whatever is still inside the lab's
namespaces and deletes them. `close()` returns what it could not remove.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import fedring
from fedring.config import JobSpec
from fedring.lab import impair, netns
from fedring.lab.impair import Loss, apply_loss
from fedring.lab.netns import AGENT_IFACE, Net
from fedring.report.files import atomic_write
from fedring.transport.mosquitto import Mosquitto

# Where this fedring is imported from: first on the lab's processes' path, with
# PYTHONSAFEPATH, so that ``python -m fedring`` runs this code and not a ``fedring/``
# folder in the working directory (which ``-m`` would otherwise put first).
CODE_ROOT = Path(fedring.__file__).resolve().parent.parent

log = logging.getLogger(__name__)


def same_code(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a process that must run this fedring (`CODE_ROOT`) whatever its
    working directory holds."""
    installed = CODE_ROOT.name in ("site-packages", "dist-packages")  # found there anyway
    path = [*([] if installed else [str(CODE_ROOT)]), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(path), "PYTHONSAFEPATH": "1"}


BROKER_PORT = 1883


class LabRunError(RuntimeError):
    """A job in the lab failed or ran past its time (the logs are named)."""


def write_job(spec: JobSpec, path: Path, fields: Mapping[str, Any] | None = None) -> Path:
    """The job as a TOML file for `fedring coordinator run` (every field, explicitly);
    `fields` are written over the spec's, unchecked here: the coordinator checks them
    (a value that only the code the coordinator runs knows)."""
    lines = ["[job]"]
    for key, value in {**spec.resolved(), **(fields or {})}.items():
        lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


class Lab:
    def __init__(
        self,
        agents: int,
        bandwidth_mbps: float,
        *,
        workdir: Path,
        downlink_mbps: float | None = None,
        profile: str = "",
        threads: int = 1,
        loss: float = 0.0,
        delay_ms: float = 0.0,
    ) -> None:
        if not 0.0 <= delay_ms <= 10_000:
            raise ValueError(f"delay_ms={delay_ms} must be in [0, 10000]")
        self.loss, self.delay_ms = Loss(AGENT_IFACE, loss, "both").loss, delay_ms
        self.net = Net(agents, os.getpid())
        self.up, self.down = bandwidth_mbps, downlink_mbps or bandwidth_mbps
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.profile, self.threads = profile, threads
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.agents: list[subprocess.Popen[bytes]] = []
        self.proxies: list[subprocess.Popen[bytes]] = []
        self.broker: Mosquitto | None = None
        self._old_handlers: dict[int, Any] = {}

    # -- building and tearing down ----------------------------------------------

    def __enter__(self) -> Lab:
        self._trap()
        try:
            netns.build(self.net, self.up, self.down)
            if self.loss:
                for node in self.net.nodes():
                    apply_loss(self.net.ns(node), Loss(AGENT_IFACE, self.loss, "both"))
            self.broker = Mosquitto(
                workdir=self.workdir / "broker", host=netns.HUB_ADDR, port=BROKER_PORT,
                prefix=self.net.exec("hub"),
            ).start()  # fmt: skip
            self._record()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        left = self.close()
        if left:
            log.error("lab left behind: %s", left)

    def _trap(self) -> None:
        """While open, SIGTERM and SIGHUP unwind the stack so teardown runs."""
        if threading.current_thread() is not threading.main_thread():
            return

        def leave(signum: int, _frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, leave)

    def close(self) -> list[str]:
        """Stop every process by PID, then delete the namespaces; return leftovers."""
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        if self.broker is not None:
            self.broker.stop()
        for _, proc in reversed(self.procs):
            stop(proc)
        left = netns.destroy(self.net.namespaces())
        alive = [f"{name} (pid {p.pid})" for name, p in self.procs if p.poll() is None]
        self._record(closed_at=time.time())  # a namespace's inode is reused after this
        return left + alive

    # -- processes ------------------------------------------------------------------

    def launch(
        self, node: str, argv: list[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on `node` ("hub" or "a<i>"), in its own session, logging to a file."""
        if node != "hub" and node not in self.net.nodes():
            raise ValueError(f"node={node!r} is not 'hub' or one of a0..a{self.net.agents - 1}")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [*self.net.exec(node), *argv], stdout=out, stderr=subprocess.STDOUT,
                env=same_code(os.environ if env is None else env), start_new_session=True,
            )  # fmt: skip
        self.procs.append((f"{node}:{Path(argv[0]).name}", proc))
        self._record()
        return proc

    def _record(self, closed_at: float | None = None) -> None:
        """`lab.json`: the namespaces (with their inodes) and every PID started, so a
        test or an operator can check afterwards that nothing outlived the lab; once
        closed, when (a process that started later, in a namespace that got one of
        these inodes again, is not the lab's)."""
        pids = [p.pid for _, p in self.procs]
        if self.broker is not None and self.broker.pid is not None:
            pids.append(self.broker.pid)
        doc: dict[str, Any] = {"prefix": self.net.prefix, "pids": pids}
        if closed_at is None:
            doc["namespaces"] = netns.inodes(self.net.namespaces())
        else:  # the namespaces and the broker are gone: keep what was recorded
            path = self.workdir / "lab.json"
            old = json.loads(path.read_text()) if path.exists() else {}
            doc.update(namespaces=old.get("namespaces", {}), pids=old.get("pids", pids),
                       closed_at=closed_at)  # fmt: skip
        atomic_write(self.workdir / "lab.json", json.dumps(doc, indent=1))  # tests poll it

    def host(self, node: str) -> str:
        return self.net.host(node)

    @property
    def broker_url(self) -> str:
        return f"mqtt://{netns.HUB_ADDR}:{BROKER_PORT}"

    def reshape(self, up_mbps: float, down_mbps: float | None = None) -> None:
        """Give every agent link a new rate (`tc qdisc replace`), without rebuilding."""
        netns.reshape(self.net, up_mbps, down_mbps)
        self.up, self.down = up_mbps, down_mbps or up_mbps

    def set_delay(self, delay_ms: float) -> None:
        """The delay for the agents and proxies started from now on (stop them first)."""
        if not 0.0 <= delay_ms <= 10_000:
            raise ValueError(f"delay_ms={delay_ms} must be in [0, 10000]")
        if self.agents or self.proxies:
            raise LabRunError("set_delay: stop the agents and proxies first")
        self.delay_ms = delay_ms

    def reach(self, node: str, target: str) -> str:
        """The HOST:PORT that `node` dials to reach `target` (HOST:PORT) across its link:
        `target` itself, or with `delay_ms` a delaying proxy on the node's loopback."""
        if not self.delay_ms:
            return target
        from fedring.bench.sessions import free_port

        listen = f"127.0.0.1:{free_port()}"
        self._proxy(node, listen, target)
        return listen

    def stop_proxies(self) -> None:
        for proc in self.proxies:
            stop(proc)
        self.proxies.clear()

    def start_agents(self) -> None:
        """One `fedring agent` daemon per agent namespace, connected to the hub's broker
        (through a delaying proxy on the agent's own loopback with `delay_ms`)."""
        for i, node in enumerate(self.net.nodes()):
            url = self.broker_url
            if self.delay_ms:
                local = f"127.0.0.1:{BROKER_PORT}"
                self._proxy(node, local, f"{netns.HUB_ADDR}:{BROKER_PORT}")
                url = f"mqtt://{local}"
            argv = [sys.executable, "-m", "fedring", "agent", "--broker", url,
                    "--id", f"lab-{i}", "--threads", str(self.threads)]  # fmt: skip
            if self.profile:
                argv += ["--profile", self.profile]
            self.agents.append(self.launch(node, argv, self.workdir / f"agent-{i}.log"))

    def _proxy(self, node: str, listen: str, target: str, timeout_s: float = 20.0) -> None:
        """Start `fedring.lab.delay` on `node`: `listen` forwards to `target`, +delay_ms
        each way; return once it listens."""
        log_path = self.workdir / f"delay-{node}-{listen.rpartition(':')[2]}.log"
        log_path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "fedring.lab.delay", "--listen", listen,
                "--target", target, "--delay-ms", f"{self.delay_ms:g}"]  # fmt: skip
        proc = self.launch(node, argv, log_path)
        self.proxies.append(proc)
        deadline = time.monotonic() + timeout_s
        while "listening on" not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LabRunError(f"delay proxy on {node} did not start; see {log_path}")
            time.sleep(0.1)

    def dropped(self) -> dict[str, int]:
        """Packets the loss rules dropped on each agent's link so far."""
        if not self.loss:
            return {}
        return {n: sum(impair.dropped(self.net.ns(n)).values()) for n in self.net.nodes()}

    def stop_agents(self) -> None:
        """Stop the agent daemons and the delay proxies."""
        for proc in self.agents:
            stop(proc)
        self.agents.clear()
        self.stop_proxies()

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        return {node: netns.link_bytes(self.net, node) for node in self.net.nodes()}

    def run_job(self, spec: JobSpec, *, name: str = "job", timeout_s: float = 600.0,
                onnx: bool = False, cap_s: float | None = None,
                fields: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """Run one job with the coordinator on the hub; its summary, per-round rows and
        the bytes each agent's interface sent and received during it.

        With `cap_s`, the coordinator is stopped once a row's ``wall_s`` (training
        seconds) passes it: the result then has ``capped`` true, the rows so far and a
        summary made from them. The agents may still be in the job: restart them."""
        out = self.workdir / name
        out.mkdir(parents=True, exist_ok=True)
        job = write_job(spec, out / "job.toml", fields)
        argv = [sys.executable, "-m", "fedring", "coordinator", "run", str(job),
                "--broker", self.broker_url, "--out", str(out), "--enrol-timeout", "120",
                "--onnx" if onnx else "--no-onnx", "--json"]  # fmt: skip
        before = self.link_bytes()
        start = time.monotonic()
        proc = self.launch("hub", argv, out / "coordinator.log")
        capped = _wait_capped(proc, out / "metrics.jsonl", timeout_s, cap_s)
        if capped is None:
            stop(proc)
            raise LabRunError(f"{name}: no result within {timeout_s:g} s; see {out}") from None
        after = self.link_bytes()
        if capped:
            stop(proc)
            rows = list(_jsonl(out / "metrics.jsonl"))
            accs = [r["accuracy"] for r in rows if "accuracy" in r]
            summary = {"final_accuracy": accs[-1] if accs else 0.0, "identical_models": True,
                       "rounds": rows[-1].get("round", 0) if rows else 0}  # fmt: skip
            return {"summary": summary, "rows": rows, "capped": True,
                    "wall_seconds": time.monotonic() - start, "out": str(out),
                    "link_bytes": {n: [after[n][0] - before[n][0], after[n][1] - before[n][1]]
                                   for n in after}}  # fmt: skip
        rc = proc.returncode
        summary_path = out / "summary.json"
        if rc != 0 or not summary_path.exists():
            tail = (out / "coordinator.log").read_text(errors="replace")[-1500:]
            raise LabRunError(f"{name}: coordinator exited {rc}; {out}/coordinator.log:\n{tail}")
        summary = json.loads(summary_path.read_text())
        rows = list(_jsonl(out / "metrics.jsonl"))
        return {
            "summary": summary,
            "rows": rows,
            "wall_seconds": time.monotonic() - start,
            "link_bytes": {
                n: [after[n][0] - before[n][0], after[n][1] - before[n][1]] for n in after
            },
            "out": str(out),
            "capped": False,
        }


def _wait_capped(
    proc: subprocess.Popen[bytes], metrics: Path, timeout_s: float, cap_s: float | None
) -> bool | None:
    """Wait for the coordinator: False when it exited, True when a row passed `cap_s`
    training seconds first, None when `timeout_s` passed first."""
    deadline, seen = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if cap_s is not None and metrics.exists():
            with metrics.open("rb") as f:
                f.seek(seen)
                data = f.read()
            done = data.rfind(b"\n") + 1  # whole lines only: one may be half-written
            seen += done
            for line in data[:done].splitlines():
                with contextlib.suppress(ValueError):
                    if float(json.loads(line).get("wall_s", 0.0)) >= cap_s:
                        return True
        time.sleep(0.2)
    return None


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM the process's session, SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace_s)

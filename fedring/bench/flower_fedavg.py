"""Baseline: plain Flower FedAvg on the deployment engine (SuperLink + SuperNodes).

What it is: the federated-learning reference point. A real SuperLink on node "hub"
and one SuperNode per client on a0..a{N-1}, each in its own session, and the app of
`fedring.bench.flower_fedavg_app` (dense fp32 models both ways, FedAvg weighted by
shard size, centralized evaluation every round) started with ``flwr run``. See that
module for the run config: lr 0.1, momentum 0.9, batch 32, one local epoch.

How it runs (all through the `Launch` hook, so it works in the lab's namespaces):

1. ``flower-superlink --insecure --host 0.0.0.0 --port P`` on "hub";
2. ``flower-supernode --superlink HUB:P --node-config "partition-id=i num-partitions=N"``
   on a{i} (each SuperNode's own Runtime API on 127.0.0.1 of its node);
3. a port probe, then ``flwr run APP CONNECTION`` on "hub": in the lab the parent
   sits in the root namespace and cannot reach HUB:P itself. ``$FLWR_HOME``
   (``OUT/flwr-home``) holds the connection;
4. wait for the ServerApp's ``OUT/summary.json``, asking ``flwr ls --format json``
   now and then whether the run failed (``flwr run`` exits 0 either way);
5. stop every session, check nothing is left.

Bytes per client: with `iface`, the kernel's tx/rx counters of that interface read
on each client node before ``flwr run`` and after the run (everything on the
interface, SuperNode heartbeats included); always, Flower's own message sizes as
`fedring.flower.metering.MeteredGrid` counts them (``uplink_bytes_per_client``,
``downlink_bytes_per_client``) and the SuperLink's ``network-traffic`` of the run.
Each training message starts a fresh ClientApp process (torch import included),
which is part of what this baseline costs per round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedring.bench.flower_fedavg_app import DEFAULTS
from fedring.bench.launch import BaselineError, Host, Launch, agent_nodes, run_on, stop_all
from fedring.bench.sessions import free_port
from fedring.flower.simulation import QUIET_ENV

BIN = Path(sys.executable).parent
CONNECTION = "fedring-bench"
Reach = Callable[[str, str], str]  # reach(node, "HOST:PORT") -> the address node dials
APP_COMPONENTS = "fedring.bench.flower_fedavg_app"

# Node-side helpers, run with `python -c SRC ARGS` through the launcher.
PROBE_SRC = """import socket, sys, time
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    with socket.socket() as s:
        s.settimeout(1.0)
        if s.connect_ex((host, port)) == 0:
            sys.exit(0)
    time.sleep(0.2)
sys.exit(f"nothing listens on {host}:{port}")
"""
IFACE_SRC = """import json, sys
from pathlib import Path
st = Path("/sys/class/net") / sys.argv[1] / "statistics"
print(json.dumps({k: int((st / k).read_text()) for k in ("tx_bytes", "rx_bytes")}))
"""


def write_app(app: Path) -> None:
    """A pyproject-only Flower app whose components live in fedring (no FAB code)."""
    app.mkdir(parents=True, exist_ok=True)
    keys = "\n".join(f"{k} = {json.dumps(v)}" for k, v in DEFAULTS.items())
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "fedring-fedavg-baseline"\nversion = "0.1.0"\n'
        'dependencies = ["flwr==1.41.0", "fedring"]\n\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["."]\n\n'
        '[tool.flwr.app]\npublisher = "fedring"\n\n'
        f'[tool.flwr.app.components]\nserverapp = "{APP_COMPONENTS}:server_app"\n'
        f'clientapp = "{APP_COMPONENTS}:client_app"\n\n[tool.flwr.app.config]\n{keys}\n'
    )


def run_config(values: Mapping[str, Any]) -> str:
    """``flwr run --run-config`` text: space-separated TOML ``key=value`` pairs."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


def run_flower_fedavg(
    n: int,
    launch: Launch,
    host: Host,
    *,
    dataset: str = "digits",
    model: str = "mlp",
    rounds: int = 30,
    target: float = 0.95,
    seed: int = 0,
    out: Path,
    lr: float = DEFAULTS["lr"],
    local_epochs: int = 1,
    iface: str | None = None,
    port: int | None = None,
    timeout_s: float = 900.0,
    env: Mapping[str, str] | None = None,
    cap_s: float = 0.0,
    reach: Reach | None = None,
) -> dict[str, Any]:
    """Run FedAvg with `n` SuperNodes; return the summary, rows and bytes per client.

    Parameters
    ----------
    n : int
        Clients, one SuperNode on each of a0..a{n-1}.
    launch, host : Launch, Host
        Where processes start and the address of "hub" (`fedring.bench.launch`).
    rounds, target : int, float
        At most `rounds`; the run stops after the first round at `target` accuracy.
    out : Path
        Gets ``metrics.jsonl``, ``summary.json``, the app, ``$FLWR_HOME`` and the logs.
    iface : str, optional
        Client interface whose kernel counters give the bytes (``eth0`` in the lab).
    port : int, optional
        SuperLink port on "hub"; a free port of this host when not given.
    timeout_s : float
        Deadline of the whole run.
    env : Mapping, optional
        Base environment (default: this process's; PYTHONPATH must reach fedring).
    cap_s : float
        Stop after the first round that ends past this many seconds (0: no cap).
    reach : Reach, optional
        ``reach(node, "HUB:P")``: the address SuperNode `node` dials for the SuperLink
        (the lab's delaying proxy on the node's loopback); default the SuperLink itself.

    Raises
    ------
    BaselineError
        A process failed, the run did not complete by `timeout_s`, or processes
        were left behind. Everything is stopped first.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    write_app(out / "app")
    home = out / "flwr-home"
    home.mkdir(exist_ok=True)
    hub, port = host("hub"), port or free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "{hub}:{port}"\ninsecure = true\n'
    )
    environ = {**(os.environ if env is None else env), **QUIET_ENV, "FLWR_HOME": str(home),
               "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
    cfg = {"clients": n, "dataset": dataset, "model": model, "seed": seed, "rounds": rounds,
           "target": float(target), "lr": float(lr), "local-epochs": local_epochs,
           "cap-s": float(cap_s), "out": str(out)}  # fmt: skip
    deadline = time.monotonic() + timeout_s
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _start_nodes(procs, launch, n, hub, port, out, environ, reach)
        py = [sys.executable, "-c"]
        run_on(launch, "hub", [*py, PROBE_SRC, hub, str(port), "60"], out / "probe.log",
               environ, 90)  # fmt: skip
        before = _iface_bytes(launch, n, iface, out, environ)
        run_id = _start_run(launch, out, environ, cfg)
        run = _wait(launch, out, environ, run_id, procs, deadline)
        after = _iface_bytes(launch, n, iface, out, environ)
    finally:
        left = stop_all(procs)
    if left:
        raise BaselineError(f"flower-fedavg: processes {left} still alive after SIGKILL")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["metrics"] = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    summary["network_traffic"] = run.get("network-traffic")
    summary["clients_bytes"] = [
        {"node": node, "source": f"kernel:{iface}",
         **{k: after[node][k] - before[node][k] for k in ("tx_bytes", "rx_bytes")}}
        for node in agent_nodes(n) if iface
    ]  # fmt: skip
    return summary


def _start_nodes(
    procs: list[subprocess.Popen[bytes]],
    launch: Launch,
    n: int,
    hub: str,
    port: int,
    out: Path,
    env: Mapping[str, str],
    reach: Reach | None = None,
) -> None:
    """The SuperLink on "hub", then SuperNode i on a{i}; each Popen goes into `procs`."""
    procs.append(launch("hub", [str(BIN / "flower-superlink"), "--insecure", "--host", "0.0.0.0",
                                "--port", str(port), "--disable-runtime-dependency-installation"],
                        out / "superlink.log", env))  # fmt: skip
    for i, node in enumerate(agent_nodes(n)):
        superlink = reach(node, f"{hub}:{port}") if reach else f"{hub}:{port}"
        # Each SuperNode's own Runtime API (for its ClientApps) stays on its node's loopback.
        procs.append(launch(node, [
            str(BIN / "flower-supernode"), "--insecure", "--superlink", superlink,
            "--host", "127.0.0.1", "--port", str(free_port()),
            "--node-config", f"partition-id={i} num-partitions={n}",
        ], out / f"supernode-{i}.log", env))  # fmt: skip


def _flwr(launch: Launch, out: Path, env: Mapping[str, str], name: str, *args: str) -> Any:
    """A `flwr` CLI call on "hub" with ``--format json``; its JSON reply."""
    text = run_on(launch, "hub", [str(BIN / "flwr"), *args, "--format", "json"],
                  out / f"flwr-{name}.log", env, 120)  # fmt: skip
    decoder = json.JSONDecoder()
    for start in (i for i, c in enumerate(text) if c == "{"):  # logs may precede the JSON
        try:
            return decoder.raw_decode(text, start)[0]
        except ValueError:
            continue
    raise BaselineError(f"flwr {args[0]}: no JSON reply:\n{text[-2000:]}")


def _start_run(launch: Launch, out: Path, env: Mapping[str, str], cfg: Mapping[str, Any]) -> str:
    reply = _flwr(launch, out, env, "run", "run", str(out / "app"), CONNECTION,
                  "--run-config", run_config(cfg))  # fmt: skip
    if "run-id" not in reply:
        raise BaselineError(f"flwr run did not start a run: {reply}")
    return str(reply["run-id"])


def _status(launch: Launch, out: Path, env: Mapping[str, str], run_id: str) -> dict[str, Any]:
    runs = _flwr(launch, out, env, "ls", "ls", CONNECTION).get("runs", [])
    run = next((r for r in runs if str(r.get("run-id")) == run_id), None)
    if run is None:
        raise BaselineError(f"flwr ls does not list run {run_id}: {runs}")
    return dict(run)


def _wait(
    launch: Launch,
    out: Path,
    env: Mapping[str, str],
    run_id: str,
    procs: list[subprocess.Popen[bytes]],
    deadline: float,
    ls_every_s: float = 15.0,
) -> dict[str, Any]:
    """Until the run is ``finished:completed``; the summary file saves most `flwr ls` calls."""
    next_ls = time.monotonic() + ls_every_s
    while time.monotonic() < deadline:
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            raise BaselineError(f"flower-fedavg: process {dead[0]} (0 = SuperLink) exited")
        done = (out / "summary.json").exists()
        if done or time.monotonic() >= next_ls:
            run = _status(launch, out, env, run_id)
            status = str(run.get("status"))
            if status == "finished:completed":
                return run
            if status.startswith("finished"):
                raise BaselineError(f"run {run_id} ended {status}; see {out}/superlink.log")
            next_ls = time.monotonic() + (1.0 if done else ls_every_s)
        time.sleep(0.5)
    raise BaselineError(f"run {run_id} not finished by the deadline; see {out}/*.log")


def _iface_bytes(
    launch: Launch, n: int, iface: str | None, out: Path, env: Mapping[str, str]
) -> dict[str, dict[str, int]]:
    if not iface:
        return {}
    counts = {}
    for node in agent_nodes(n):
        text = run_on(launch, node, [sys.executable, "-c", IFACE_SRC, iface],
                      out / f"iface-{node}.log", env, 60)  # fmt: skip
        counts[node] = json.loads(text.strip().splitlines()[-1])
    return counts

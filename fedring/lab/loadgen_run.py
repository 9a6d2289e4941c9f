"""One fleet-scale scenario: a fresh Mosquitto, a real coordinator process, N protocol agents.

`run_scenario` starts Mosquitto on loopback, writes the scenario's job file, starts
``fedring coordinator run`` as a process, waits for its retained presence, then runs
a `LoadFleet` of N agents against it until every agent has its ``bye``. Meanwhile it
samples the coordinator's and the broker's CPU seconds and resident memory
(`ProcSample`) at the start of the fleet, when every agent has acknowledged its
manifest, and when the last one finished, so that enrolment and the rounds are
costed apart. Everything started is stopped by PID, on failure too.

Scenarios (`SCENARIOS`): ``star`` (every agent sends each round), ``sampling`` (a
star where 10 % send each round; all get the reply), ``async`` (each agent's delta
answered at once with the model; versions stand for rounds, about two per agent),
``ring`` (a flat ring: 2(N-1) chunk exchanges between neighbours a round, which the
coordinator never sees; it gets the head's row each round and the checkpoint stream).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from fedring.lab.loadgen import LoadSettings
from fedring.lab.loadgen_fleet import LoadFleet, ProcSample
from fedring.lab.loadgen_mqtt import MqttConn
from fedring.transport import topics
from fedring.transport.mosquitto import Mosquitto

SCENARIOS = ("star", "sampling", "async", "ring")
DATASET, MODEL = "synthetic:20000:32:4", "mlp"  # 12,740 parameters


def job_toml(mode: str, n: int, rounds: int) -> str:
    """The scenario's job: `rounds` star or ring rounds, or (async) about 2 versions an
    agent."""
    if mode not in SCENARIOS:
        raise ValueError(f"scenario {mode!r} must be one of {SCENARIOS}")
    topology = "ring" if mode == "ring" else "star"
    lines = [
        "[job]", f"agents = {n}", f'dataset = "{DATASET}"', f'model = "{MODEL}"',
        f'topology = "{topology}"', "density = 0.01", "density_warmup = 0", 'init = "sent"',
        "seed = 0", "timeout_s = 120.0",
    ]  # fmt: skip
    if mode == "async":
        versions = max(rounds, 2 * n)
        lines += ['sync = "async"', f"rounds = {versions}", f"eval_every = {versions}",
                  f"checkpoint_every = {n}"]  # fmt: skip
    else:
        lines += [f"rounds = {rounds}", f"eval_every = {rounds}", "checkpoint_every = 1"]
        if mode == "sampling":
            lines.append("sample = 0.1")
    return "\n".join(lines) + "\n"


async def _coordinator_online(host: str, port: int, timeout_s: float) -> None:
    """Until the coordinator's retained status says online."""
    seen = asyncio.Event()

    def heard(topic: str, payload: bytes, retained: bool) -> None:
        if b'"online"' in payload:
            seen.set()

    conn = MqttConn(f"fedring-watch-{os.getpid()}", heard)
    await conn.open(host, port, 30)
    conn.subscribe([(topics.status(topics.COORDINATOR), 1)])
    try:
        await asyncio.wait_for(seen.wait(), timeout_s)
    finally:
        conn.close()


async def _fleet(settings: LoadSettings, n: int, coord: int, broker: int,
                 timeout_s: float) -> dict[str, Any]:  # fmt: skip
    fleet = LoadFleet(settings, n)
    samples: dict[str, tuple[ProcSample, ProcSample, ProcSample]] = {}

    def mark(name: str) -> None:  # the load generator's own too: a ring's steps are mostly its
        samples[name] = (ProcSample.read(coord), ProcSample.read(broker),
                         ProcSample.read(os.getpid()))  # fmt: skip

    peak = [0]

    async def watch() -> None:
        while True:
            with_rss = ProcSample.read(coord).rss
            peak[0] = max(peak[0], with_rss)
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    try:
        mark("start")
        await fleet.start()
        if not await fleet.wait_until("acked", timeout_s):
            raise TimeoutError(
                f"{fleet.acked} of {n} agents acknowledged a manifest in {timeout_s} s"
            )
        mark("acked")
        if not await fleet.wait_until("finished", timeout_s):
            raise TimeoutError(f"{fleet.finished} of {n} agents finished in {timeout_s} s")
        mark("done")
        report = fleet.report()
    finally:
        watcher.cancel()
        await fleet.stop()
    report["coordinator_peak_rss"] = peak[0]
    report["samples"] = {
        k: {"coordinator": vars(c), "broker": vars(b), "loadgen": vars(g)}
        for k, (c, b, g) in samples.items()
    }
    return report


def run_scenario(mode: str, n: int, rounds: int, workdir: Path, *, timeout_s: float = 600.0,
                 presence: str = "peers") -> dict[str, Any]:  # fmt: skip
    """Run one scenario; the figures `bench/fleet_scale.py` tabulates."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = workdir / "job.toml"
    job.write_text(job_toml(mode, n, rounds))
    out = workdir / "out"
    with Mosquitto(workdir=workdir / "broker") as broker:
        assert broker.pid is not None
        cmd = [sys.executable, "-m", "fedring", "coordinator", "run", str(job),
               "--broker", broker.url, "--out", str(out), "--min-agents", str(n),
               "--enrol-timeout", str(timeout_s), "--no-onnx", "--quiet", "--json"]  # fmt: skip
        log = (workdir / "coordinator.log").open("w")
        coord = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        try:
            asyncio.run(_coordinator_online(broker.host, broker.port, 60.0))
            settings = LoadSettings(broker.host, broker.port, presence=presence)
            report = asyncio.run(_fleet(settings, n, coord.pid, broker.pid, timeout_s))
            stdout, _ = coord.communicate(timeout=120)
        finally:
            if coord.poll() is None:
                os.killpg(coord.pid, signal.SIGTERM)
                coord.wait(10)
            log.close()
    if coord.returncode != 0:
        tail = (workdir / "coordinator.log").read_text()[-2000:]
        raise RuntimeError(f"coordinator exited {coord.returncode}: {tail}")
    summary = json.loads(stdout.decode().strip().splitlines()[-1])
    return {"mode": mode, "agents": n, "rounds": _rounds(mode, summary, rounds),
            **_costs(report), "loadgen": report, "summary": _summary_view(summary)}  # fmt: skip


def _rounds(mode: str, summary: dict[str, Any], rounds: int) -> int:
    if mode == "async":
        return int(summary.get("centre_rounds") or summary.get("rounds") or rounds)
    return rounds


def _costs(report: dict[str, Any]) -> dict[str, Any]:
    s = report["samples"]

    def cpu(who: str, a: str, b: str) -> float:
        return round(s[b][who]["cpu_s"] - s[a][who]["cpu_s"], 3)

    return {
        "enrol_s": report["enrol_s"], "connected_s": report["connected_s"],
        "enrol_after_hellos_s": report["enrol_after_hellos_s"],
        "train_s": round(s["done"]["coordinator"]["t"] - s["acked"]["coordinator"]["t"], 3),
        "coordinator_cpu_enrol_s": cpu("coordinator", "start", "acked"),
        "coordinator_cpu_rounds_s": cpu("coordinator", "acked", "done"),
        "broker_cpu_enrol_s": cpu("broker", "start", "acked"),
        "broker_cpu_rounds_s": cpu("broker", "acked", "done"),
        "loadgen_cpu_rounds_s": cpu("loadgen", "acked", "done"),  # all N agents together
        "coordinator_rss_mb": round(report["coordinator_peak_rss"] / 2**20, 1),
        "broker_rss_mb": round(s["done"]["broker"]["rss"] / 2**20, 1),
    }  # fmt: skip


def _summary_view(summary: dict[str, Any]) -> dict[str, Any]:
    keep = ("job", "agents", "rounds", "centre_rounds", "bytes_received", "bytes_sent",
            "reformations", "wall_s", "layout")  # fmt: skip
    view = {k: summary[k] for k in keep if k in summary}
    counters = summary.get("counters", {})
    view["counters"] = {k: v for k, v in counters.items() if v}
    return view

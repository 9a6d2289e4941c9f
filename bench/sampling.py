"""Client sampling: 10 of 50 agents a round, compressed uplinks against plain FedAvg.

Digits, MLP (17,226 parameters), iid shards, 50 agents, a seeded sample of 10 a
round (`sample = 10`), H = 12 local momentum-SGD steps of 32 samples at lr 0.05,
a star whose centre averages the sample's deltas and sends every agent the
result. Two jobs per runner, differing only in the uplink:

- plain FedAvg: dense fp32 deltas (``compression = "none"``);
- fedring: group-top-k (density 4%, fp16 values) with error feedback, and the
  `sit_out` policy for an agent's residual when it is sampled again.

Runners, each printing both jobs from one run:

- ``simulate``: `fedring simulate` in this process (every `sit_out` policy);
- ``mqtt``: the coordinator over a real Mosquitto (loopback) with `--mqtt-agents`
  `fedring agent` daemons (50 by default; pass fewer where memory is short,
  ~300 MB each). Skipped with ``--no-mqtt``;
- ``flower``: fedring's ServerApp on Flower's simulation engine (`fedring flower
  simulate`, FedAvgM server momentum 0.5 as there by default, dense downlink).

Uplink bytes per agent: what an agent sent over the run (fedring frames; for
Flower, the deflated reply messages), averaged over the agents; the ratio is
FedAvg's divided by ours.

    python bench/sampling.py [--rounds 40] [--density 0.04] [--no-mqtt] [--no-flower] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from fedring.config import JobSpec
from fedring.sim.runner import simulate

POLICIES = ("keep", "reset", "decay:0.5")


def base_job(agents: int, rounds: int) -> JobSpec:
    return JobSpec(
        agents=agents, dataset="digits", topology="star", sync="local", local_steps=12,
        lr=0.05, rounds=rounds, eval_every=10, sample=10, density_warmup=0, timeout_s=60.0,
    )  # fmt: skip


def row(name: str, summary: dict[str, Any], up_key: str) -> dict[str, Any]:
    return {"job": name, "accuracy": float(summary["final_accuracy"]),
            "uplink_bytes_per_agent": float(summary[up_key]),
            "wall_seconds": float(summary["wall_seconds"])}  # fmt: skip


def in_process(base: JobSpec, density: float) -> list[dict[str, Any]]:
    rows = [row("plain FedAvg (dense fp32)", simulate(base.replace(compression="none")),
                "bytes_sent_per_agent")]  # fmt: skip
    for policy in POLICIES:
        spec = base.replace(density=density, sit_out=policy)
        rows.append(row(f"group-top-k, sit_out={policy}", simulate(spec), "bytes_sent_per_agent"))
    return rows


def over_mqtt(base: JobSpec, density: float, agents: int) -> list[dict[str, Any]]:
    from fedring.bench.mqtt import _Daemons
    from fedring.coordinator.service import Coordinator, Options
    from fedring.transport.mosquitto import Mosquitto
    from fedring.transport.mqtt import BrokerConfig

    spec = base.replace(agents=agents)
    work = Path(tempfile.mkdtemp(prefix="fedring-bench-sampling-"))
    rows = []
    with Mosquitto(workdir=work / "broker") as broker:
        daemons = _Daemons(broker.url, work)
        try:
            daemons.start([f"s{i:02d}" for i in range(agents)])
            cfg = BrokerConfig.parse(broker.url, username="coordinator")
            for name, job in (("plain FedAvg (dense fp32)", spec.replace(compression="none")),
                              ("group-top-k, sit_out=keep", spec.replace(density=density))):
                opts = Options(out=work / name.split()[0], enrol_timeout_s=300.0,
                               export_onnx=False)  # fmt: skip
                rows.append(row(name, Coordinator(job, cfg, opts).run(), "bytes_sent_per_agent"))
        finally:
            daemons.stop()
    return rows


def on_flower(base: JobSpec, density: float) -> list[dict[str, Any]]:
    from fedring.flower.job import FlowerJob
    from fedring.flower.simulation import simulate as flower_simulate

    rows = []
    with tempfile.TemporaryDirectory(prefix="fedring-bench-sampling-") as tmp:
        for name, spec in (("plain FedAvg (dense fp32)", base.replace(compression="none")),
                           ("group-top-k, sit_out=keep", base.replace(density=density))):
            s = flower_simulate(FlowerJob(spec), Path(tmp) / name.split()[0], timeout_s=1800)
            rows.append(row(name, s, "uplink_bytes_per_client"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--density", type=float, default=0.04)
    parser.add_argument("--mqtt-agents", type=int, default=50)
    parser.add_argument("--no-mqtt", action="store_true")
    parser.add_argument("--no-flower", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = base_job(args.agents, args.rounds)
    runs = {"simulate": in_process(base, args.density)}
    if not args.no_mqtt:
        runs[f"mqtt ({args.mqtt_agents} daemons)"] = over_mqtt(base, args.density, args.mqtt_agents)
    if not args.no_flower:
        runs["flower"] = on_flower(base, args.density)
    if args.json:
        print(json.dumps(runs))
        return
    print(f"digits, {args.agents} agents, 10 sampled a round, {args.rounds} rounds, "
          f"group-top-k density {args.density}")  # fmt: skip
    print(f"{'runner':22} {'job':30} {'accuracy':>9} {'vs FedAvg':>10} {'uplink B/agent':>15} "
          f"{'x fewer':>8} {'wall s':>7}")  # fmt: skip
    for runner, rows in runs.items():
        fedavg = rows[0]
        for r in rows:
            pp = 100 * (r["accuracy"] - fedavg["accuracy"])
            ratio = fedavg["uplink_bytes_per_agent"] / r["uplink_bytes_per_agent"]
            up, wall = r["uplink_bytes_per_agent"], r["wall_seconds"]
            print(f"{runner:22} {r['job']:30} {r['accuracy']:9.4f} {pp:+8.2f}pp "
                  f"{up:15,.0f} {ratio:7.1f}x {wall:7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

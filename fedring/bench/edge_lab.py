"""`fedring bench lab`: time to accuracy on shaped links, fedring beside its peers, one run.

One `Lab` (N agent namespaces behind `tc tbf` links of the same bandwidth, a hub
with Mosquitto) hosts every method in turn, on the same task, data shards and
initial model:

- fedring, group-top-k 1 % + error feedback, ring over MQTT: ``sync`` and ``local``;
- fedring, dense ring over MQTT (the same code with ``compression = "none"``);
- Flower FedAvg, dense, through a SuperLink on the hub and a SuperNode per agent;
- torch.distributed DDP (gloo), dense all-reduce between the agent namespaces.

Each method stops at the task's target accuracy (or its round budget). Time to
target counts training only, from the moment every worker is ready (fedring: every
agent acknowledged the manifest; DDP: after the process group formed; Flower: the
first round's start); process start-up, dataset loading and enrolment are left out
for all alike and reported as `wall_seconds`. Bytes are what the kernel counted on
each agent's interface while the method ran, so MQTT, gRPC and TCP overheads are in.

Why one module of 350 lines: the three methods run under the same lab, clock and
byte accounting, and must stay visibly alike for the comparison to be fair.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedring.config import JobSpec
from fedring.lab.lab import Lab
from fedring.lab.netns import AGENT_IFACE


@dataclass(frozen=True)
class Task:
    name: str
    dataset: str
    model: str
    target: float
    rounds: int  # budget for the ring methods (one round = one step)

    @property
    def label(self) -> str:
        return f"{self.dataset} {self.model} to {self.target:.0%}"


TASKS = {
    # 301 k parameters: a dense exchange costs ~1.4 s per round on 10 Mbit/s links.
    "digits": Task("digits", "digits", "mlp:512x512", 0.95, 300),
    # The MNIST-1D paper's CNN: 5 k parameters, so its dense exchange is cheap.
    "mnist1d": Task("mnist1d", "mnist1d", "cnn", 0.85, 1500),
}

FLOWER_ROUNDS = 40  # FedAvg rounds at most (one local epoch each); it stops at the target

FEDRING: dict[str, dict[str, Any]] = {
    "fedring group-top-k 1% sync": {"compression": "group-topk", "density": 0.01},
    "fedring group-top-k 1% local H=8": {"compression": "group-topk", "density": 0.01,
                                         "sync": "local", "local_steps": 8},
    "fedring dense ring": {"compression": "none"},
}  # fmt: skip


@dataclass
class Row:
    method: str
    task: str
    target: float
    seconds_to_target: float | None
    rounds_to_target: int | None
    final_accuracy: float
    rounds: int
    bytes_sent_per_agent: float
    bytes_received_per_agent: float
    wall_seconds: float
    curve: list[tuple[float, float]] = field(default_factory=list)  # (seconds, accuracy)
    note: str = ""


def to_target(
    curve: list[tuple[float, float, int]], target: float
) -> tuple[float | None, int | None]:
    """(seconds, round) of the first point at or above `target`."""
    for t, acc, r in curve:
        if acc >= target:
            return t, r
    return None, None


def _mean_bytes(per_node: dict[str, Any]) -> tuple[float, float]:
    """Mean (sent, received) over the agents of {node: (sent, received)}."""
    sent = [b[0] for b in per_node.values()]
    received = [b[1] for b in per_node.values()]
    return sum(sent) / len(sent), sum(received) / len(received)


def _bytes(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> tuple[float, float]:
    return _mean_bytes({n: (a[0] - before[n][0], a[1] - before[n][1]) for n, a in after.items()})


def fedring_row(lab: Lab, task: Task, method: str, overrides: dict[str, Any], seed: int,
                timeout_s: float) -> Row:  # fmt: skip
    spec = JobSpec(
        agents=lab.net.agents, dataset=task.dataset, model=task.model, rounds=task.rounds,
        eval_every=_eval_every(task), target_accuracy=task.target, seed=seed,
        checkpoint_every=task.rounds, timeout_s=60.0, **overrides,
    )  # fmt: skip
    name = f"{task.name}-{method.replace(' ', '_').replace('%', '').replace('=', '')}"
    result = lab.run_job(spec, name=name, timeout_s=timeout_s)
    points = [(float(r["wall_s"]), float(r["accuracy"]), int(r["round"]))
              for r in result["rows"] if "accuracy" in r and "wall_s" in r]  # fmt: skip
    seconds, rounds = to_target(points, task.target)
    sent, received = _mean_bytes(result["link_bytes"])
    summary = result["summary"]
    return Row(
        method, task.name, task.target, seconds, rounds, float(summary["final_accuracy"]),
        int(summary["rounds"]), sent, received,
        float(result["wall_seconds"]), [(t, a) for t, a, _ in points],
        note="" if summary["identical_models"] else "models differ",
    )  # fmt: skip


Baseline = Callable[[Lab, Task, int, Path, float], Row]


def run(
    agents: int = 4,
    bandwidth_mbps: float = 10.0,
    tasks: tuple[str | Task, ...] = ("digits", "mnist1d"),
    methods: tuple[str, ...] = (),
    seed: int = 0,
    out: Path = Path("runs/edge-lab"),
    timeout_s: float = 900.0,
    baselines: dict[str, Baseline] | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> dict[str, Any]:
    """Every method on every task in one lab; the rows, then a plot and a report."""
    out.mkdir(parents=True, exist_ok=True)
    chosen = methods or (*FEDRING, *(baselines or {}))
    rows: list[Row] = []
    labels: dict[str, str] = {}
    start = time.monotonic()
    with Lab(agents, bandwidth_mbps, workdir=out) as lab:
        for name in tasks:
            task = TASKS[name] if isinstance(name, str) else name
            labels[task.name] = task.label
            for method, baseline in (baselines or {}).items():  # before the agent daemons start
                if method in chosen:
                    rows.append(_measured(lab, baseline, task, seed, out, timeout_s))
                    _tell(on_row, rows[-1])
            lab.start_agents()
            for method, overrides in FEDRING.items():
                if method in chosen:
                    rows.append(fedring_row(lab, task, method, overrides, seed, timeout_s))
                    _tell(on_row, rows[-1])
            lab.stop_agents()
    doc = {
        "agents": agents, "bandwidth_mbps": bandwidth_mbps, "seed": seed,
        "bench_seconds": time.monotonic() - start, "rows": [r.__dict__ for r in rows],
        "speedups": speedups(rows),
    }  # fmt: skip
    (out / "edge_lab.json").write_text(json.dumps(doc, indent=1))
    doc["plot"] = str(plot(rows, out / "edge_lab.png", agents, bandwidth_mbps, labels))
    return doc


def default_baselines() -> dict[str, Baseline]:
    """Flower FedAvg through SuperLink/SuperNodes, and gloo DDP, on the lab's nodes."""
    return {"Flower FedAvg (SuperLink)": flower_row, "torch DDP gloo": ddp_row}


def _baseline_row(method: str, task: Task, summary: dict[str, Any], wall: float) -> Row:
    points = [(float(m["t"]), float(m["accuracy"]), int(m["round"])) for m in summary["metrics"]]
    seconds, rounds = to_target(points, task.target)
    return Row(
        method, task.name, task.target, seconds, rounds, float(summary["final_accuracy"]),
        int(summary["rounds"]), 0.0, 0.0, wall, [(t, a) for t, a, _ in points],
    )  # fmt: skip


def ddp_row(lab: Lab, task: Task, seed: int, out: Path, timeout_s: float) -> Row:
    """Dense all-reduce with DistributedDataParallel over gloo, rank i on agent i."""
    from fedring.bench.ddp import run_ddp

    start = time.monotonic()
    summary = run_ddp(
        lab.net.agents, lab.launch, lab.host, dataset=task.dataset, model=task.model,
        rounds=task.rounds, eval_every=_eval_every(task), target=task.target, seed=seed,
        out=out / f"{task.name}-ddp", iface=AGENT_IFACE, timeout_s=timeout_s,
    )  # fmt: skip
    return _baseline_row("torch DDP gloo", task, summary, time.monotonic() - start)


def flower_row(lab: Lab, task: Task, seed: int, out: Path, timeout_s: float) -> Row:
    """Plain FedAvg, one local epoch per round, SuperLink on the hub, a SuperNode per agent."""
    from fedring.bench.flower_fedavg import run_flower_fedavg

    start = time.monotonic()
    summary = run_flower_fedavg(
        lab.net.agents, lab.launch, lab.host, dataset=task.dataset, model=task.model,
        rounds=FLOWER_ROUNDS, target=task.target, seed=seed, out=out / f"{task.name}-flower",
        timeout_s=timeout_s,
    )  # fmt: skip
    row = _baseline_row("Flower FedAvg (SuperLink)", task, summary, time.monotonic() - start)
    row.note = "one local epoch per round"
    return row


def _eval_every(task: Task) -> int:
    return 5 if task.rounds <= 300 else 10


def _measured(lab: Lab, baseline: Baseline, task: Task, seed: int, out: Path,
              timeout_s: float) -> Row:  # fmt: skip
    before = lab.link_bytes()
    row = baseline(lab, task, seed, out, timeout_s)
    row.bytes_sent_per_agent, row.bytes_received_per_agent = _bytes(before, lab.link_bytes())
    return row


def _tell(on_row: Callable[[Row], None] | None, row: Row) -> None:
    if on_row is not None:
        on_row(row)


def speedups(rows: list[Row]) -> dict[str, dict[str, float | None]]:
    """Per task: every method's time to target over fedring's fastest compressed one."""
    out: dict[str, dict[str, float | None]] = {}
    for task in sorted({r.task for r in rows}):
        mine = [
            r.seconds_to_target
            for r in rows
            if r.task == task and "group-top-k" in r.method and r.seconds_to_target
        ]
        if not mine:
            continue
        best = min(t for t in mine if t is not None)
        out[task] = {r.method: (r.seconds_to_target / best if r.seconds_to_target else None)
                     for r in rows if r.task == task}  # fmt: skip
    return out


def plot(
    rows: list[Row], path: Path, agents: int, bandwidth: float, labels: dict[str, str]
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r.task for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for r in (r for r in rows if r.task == task):
            points = [(t, a) for t, a in r.curve if t > 0]  # a log axis: round 0 is at t = 0
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker=".", label=r.method)
            ax.axhline(r.target, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("wall-clock seconds of training (log)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{labels.get(task, task)}: {agents} agents, {bandwidth:g} Mbit/s each")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(doc: dict[str, Any]) -> str:
    """The rows as a Markdown table, with each method's time over fedring's best."""
    lines = [
        "| task | method | s to target | rounds | × fedring | final acc "
        "| MB sent/agent | MB recv/agent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        ratio = doc["speedups"].get(r["task"], {}).get(r["method"])
        secs = f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] else "not reached"
        lines.append(
            f"| {r['task']} | {r['method']} | {secs} | {r['rounds_to_target'] or r['rounds']} | "
            f"{f'{ratio:.1f}×' if ratio else '–'} | {r['final_accuracy']:.4f} | "
            f"{r['bytes_sent_per_agent'] / 1e6:.2f} | {r['bytes_received_per_agent'] / 1e6:.2f} |"
        )
    return "\n".join(lines)


OVERLAP_JOB: dict[str, Any] = {
    # Compute and communication of the same order, and communication that is link
    # time rather than CPU (two agents share this host's two cores): the 2-D CNN
    # (38 k parameters, 153 KB dense) on digits, batch 512, the dense ring, lr fixed.
    "dataset": "digits", "model": "cnn", "compression": "none", "batch_size": 512,
    "lr": 0.025, "lr_scaling": "none",
}  # fmt: skip
OVERLAP_VARIANTS: dict[str, dict[str, Any]] = {
    "sequential": {},
    "update_delay=1": {"update_delay": 1},
    "bucket_kb=64": {"bucket_kb": 64},
}


def overlap(
    agents: int = 2,
    bandwidths: tuple[float, ...] = (60.0, 40.0, 25.0),
    rounds: int = 60,
    out: Path = Path("runs/edge-lab-overlap"),
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Median compute, communication and step seconds of a sync round, with and
    without overlap, from the ring head's rows (the first 10 rounds left out)."""
    from statistics import median

    found = []
    for bw in bandwidths:
        with Lab(agents, bw, workdir=out / f"{bw:g}mbit") as lab:
            lab.start_agents()
            for name, extra in OVERLAP_VARIANTS.items():
                spec = JobSpec(agents=agents, rounds=rounds, eval_every=rounds, timeout_s=60.0,
                               checkpoint_every=rounds, **OVERLAP_JOB).replace(**extra)  # fmt: skip
                tag = name.replace("=", "")
                result = lab.run_job(spec, name=tag, timeout_s=timeout_s)
                rows = result["rows"][10:-1]  # warm-up, and the last with the final upload
                ms = {
                    k: 1000 * median(r[k] for r in rows) for k in ("compute_s", "comm_s", "step_s")
                }
                found.append({"bandwidth_mbps": bw, "variant": name, **ms,
                              "final_accuracy": result["summary"]["final_accuracy"]})  # fmt: skip
    (out / "overlap.json").write_text(json.dumps(found, indent=1))
    return found


def overlap_table(found: list[dict[str, Any]]) -> str:
    """Each step over the larger of its own compute and comm, and over the larger of
    the compute and comm the sequential run measured at the same bandwidth."""
    lines = ["| Mbit/s | variant | compute ms | comm ms | step ms | step ÷ max(own compute, "
             "comm) | step ÷ max(sequential compute, comm) | final acc |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for f in found:
        base = next(b for b in found if b["variant"] == "sequential"
                    and b["bandwidth_mbps"] == f["bandwidth_mbps"])  # fmt: skip
        ratio = f["step_s"] / max(base["compute_s"], base["comm_s"])
        own = f["step_s"] / max(f["compute_s"], f["comm_s"])
        lines.append(f"| {f['bandwidth_mbps']:g} | {f['variant']} | {f['compute_s']:.1f} | "
                     f"{f['comm_s']:.1f} | {f['step_s']:.1f} | {own:.2f} | {ratio:.2f} | "
                     f"{f['final_accuracy']:.4f} |")  # fmt: skip
    return "\n".join(lines)

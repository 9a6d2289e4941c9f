"""A virtual clock for `fedring simulate --fleet rpi4:4,jetson-orin-nano:2`.

Training runs on this machine; the clock says how long the same rounds would take
on the fleet, from the boards' profiles:

- **compute** of one local step on board b = (this machine's measured step time,
  one thread) x (this machine's measured fp64 matmul GFLOPS, one thread) /
  (b's sustained HPL GFLOPS, all cores). Optimistic for tiny models, whose steps
  do not spread over four cores.
- **communication** of one ring step: every agent sends one chunk to the broker and
  receives one (with `fanout` N-1 payloads down, with `hub` up to N: `step_bytes`),
  so it costs the two one-way latencies plus the bytes over the
  agent's link; agents on Wi-Fi share one channel (airtime divided by their
  number, up and down both counted), and the broker's own port carries all
  frames in and out at `BROKER_MBPS`. The ring step waits for the slowest agent.
- a **round** = the slowest agent's compute + the ring's steps (2(N-1) for a ring,
  sum(2(Di-1)) over the axes of a grid, e.g. 14 for 2x4x4).

Bytes are what the agents really sent in the run (frames included), per round.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from fedring.config import JobSpec
from fedring.firmware_profiles.apply import check_budget, job_memory
from fedring.firmware_profiles.schema import Link, Profile, ProfileError, load_builtin

BROKER_MBPS = 940.0  # the broker on Gigabit Ethernet (TCP goodput ceiling)
DEFAULT_TARGET = 0.9  # accuracy the "time to target" estimate uses when the job sets none


class FleetError(ValueError):
    """A --fleet value that cannot be used; the message names it."""


@dataclass(frozen=True)
class Member:
    profile: Profile
    link: Link

    @property
    def label(self) -> str:
        return f"{self.profile.name}/{self.link.name}"


def parse_fleet(text: str) -> list[Member]:
    """``NAME[/LINK][:COUNT],...`` e.g. ``rpi4:4,jetson-orin-nano/wifi:2``."""
    members: list[Member] = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"([A-Za-z0-9_.+-]+)(?:/(wifi|ethernet))?(?::(\d+))?", part)
        if m is None:
            raise FleetError(f"--fleet {text!r}: {part!r} is not NAME[/wifi|/ethernet][:COUNT]")
        try:
            profile = load_builtin(m.group(1))
            link = profile.link(m.group(2))
        except ProfileError as exc:
            raise FleetError(f"--fleet {text!r}: {exc}") from None
        count = int(m.group(3) or 1)
        if not 1 <= count <= 1024:
            raise FleetError(f"--fleet {text!r}: count {count} must be in [1, 1024]")
        members += [Member(profile, link)] * count
    return members


def check_fleet(spec: JobSpec, fleet: list[Member]) -> None:
    """Refuse the job before training: fleet size differs from the job's, or a board's
    memory budget is too small (OverBudget, with the estimate and the budget)."""
    if spec.agents != len(fleet):
        raise FleetError(f"--fleet has {len(fleet)} boards but the job has agents={spec.agents}")
    if spec.sync == "async":
        raise FleetError("--fleet: the virtual clock models synchronous rounds, not sync='async'")
    estimate = job_memory(spec)
    for profile in {m.profile.name: m.profile for m in fleet}.values():
        check_budget(profile, estimate)


@dataclass(frozen=True)
class HostSpeed:
    step_s: float  # one forward/backward of the job's model on one batch, one thread
    gflops: float  # fp64 matmul, one thread (HPL, the boards' figure, is fp64)


def measure_host(spec: JobSpec, repeats: int = 15) -> HostSpeed:
    from fedring.build import task_of

    task = task_of(spec)
    ds = task.dataset(spec.seed)
    model = task.model(ds, spec.seed)
    xb, yb = ds.x_train[: spec.batch_size], ds.y_train[: spec.batch_size]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for i in range(repeats + 3):
            start = time.perf_counter()
            model.zero_grad()
            task.loss(model(xb), yb).backward()
            if i >= 3:  # warm-up
                times.append(time.perf_counter() - start)
        a = torch.randn(384, 384, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        best = min(_timed(lambda: a @ a) for _ in range(7))
    finally:
        torch.set_num_threads(threads)
    return HostSpeed(statistics.median(times), 2 * 384**3 / best / 1e9)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ring_steps(layout: str, agents: int) -> int:
    """Steps of one all-reduce for a summary's `layout`: sum(2(Di-1)) over a grid's axes."""
    torus = re.fullmatch(r"torus (\d+(?:x\d+)+)", layout)
    if torus:
        return sum(2 * (int(d) - 1) for d in torus.group(1).split("x"))
    if layout == "star" or layout.startswith("hub "):
        return 2
    if layout.startswith("fanout "):
        return 1
    return 2 * (agents - 1)


def step_bytes(layout: str, agents: int, sent: float) -> float:
    """What the busiest link carries in one step, from what an agent sent in it: a
    ring's chunk goes up and down once; a fan-out member's downlink carries the other
    N-1 members' payloads; the hub's carries N-1 payloads, then each member's the sum
    (N payloads at most: an upper bound)."""
    if layout.startswith("fanout "):
        return (agents - 1) * sent
    if layout.startswith("hub "):
        return agents * sent
    return sent


def step_seconds(fleet: list[Member], chunk_bytes: float) -> float:
    """One ring step: every agent sends and receives `chunk_bytes` through the broker."""
    n = len(fleet)
    on_air = sum(1 for m in fleet if m.link.shared_medium)
    worst = 0.0
    for m in fleet:
        bits_per_s = m.link.bandwidth_mbps * 1e6
        if m.link.shared_medium:  # one channel: all agents' up and down frames share it
            transfer = 2 * on_air * chunk_bytes * 8 / bits_per_s
        else:  # switched, full duplex: up and down overlap
            transfer = chunk_bytes * 8 / bits_per_s
        worst = max(worst, 2 * m.link.latency_ms / 1000 + transfer)
    broker = n * chunk_bytes * 8 / (BROKER_MBPS * 1e6)
    return max(worst, broker + 2 * max(m.link.latency_ms for m in fleet) / 1000)


def estimate(
    spec: JobSpec, summary: dict[str, Any], fleet: list[Member], host: HostSpeed
) -> dict[str, Any]:
    """Add ``sim_seconds`` to every row and return the fleet's totals for the summary."""
    if spec.sync == "async":
        raise FleetError("--fleet: the virtual clock models synchronous rounds, not sync='async'")
    rows = summary["rows"]
    layout = str(summary.get("layout", ""))
    steps = ring_steps(layout, spec.agents)
    compute_per_step = max(host.step_s * host.gflops / m.profile.gflops for m in fleet)
    clock, sent_before, comm_total = 0.0, 0.0, 0.0
    for row in rows:
        sent = float(row["bytes_sent"]) - sent_before  # cumulative per agent in the run
        sent_before = float(row["bytes_sent"])
        comm = steps * step_seconds(fleet, step_bytes(layout, spec.agents, sent / steps))
        comm = comm if steps and sent > 0 else 0.0
        clock += int(row.get("interval", 1) if spec.sync != "sync" else 1) * compute_per_step
        clock += comm
        comm_total += comm
        row["sim_seconds"] = clock
    target = spec.target_accuracy or DEFAULT_TARGET
    reached = next((r for r in rows if r.get("accuracy", -1.0) >= target), None)
    n = max(1, len(rows))
    return {
        "fleet": _describe(fleet),
        "sim_seconds": clock,
        "sim_compute_seconds_per_round": (clock - comm_total) / n,
        "sim_comm_seconds_per_round": comm_total / n,
        "sim_target_accuracy": target,
        "sim_rounds_to_target": reached["round"] if reached else None,
        "sim_seconds_to_target": reached["sim_seconds"] if reached else None,
        "host_step_ms": host.step_s * 1000,
        "host_gflops_1thread": host.gflops,
    }


def _describe(fleet: list[Member]) -> str:
    counts: dict[str, int] = {}
    for m in fleet:
        counts[m.label] = counts.get(m.label, 0) + 1
    return ",".join(f"{k}:{v}" for k, v in counts.items())

"""Checks that a lab left nothing behind, from the `lab.json` it wrote."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

from fedring.lab import netns


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def started_at(pid: int) -> float:
    """The process's start, in seconds since the epoch (to a clock tick; boot time to
    the second); +inf if it is gone."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, IndexError, ValueError):
        return math.inf
    boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))  # fmt: skip
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def leftovers(workdir: Path) -> list[str]:
    """Namespaces, processes and qdiscs of the lab that wrote `workdir/lab.json`."""
    doc = json.loads((workdir / "lab.json").read_text())
    names = set(doc["namespaces"])
    left = [f"namespace {n}" for n in netns.existing(doc["prefix"]) if n in names]
    inside = netns.processes_in(set(doc["namespaces"].values()))
    closed = doc.get("closed_at")  # a later namespace may reuse a deleted one's inode:
    left += [f"pid {p} inside a lab namespace" for p in inside  # its processes start later
             if alive(p) and (closed is None or started_at(p) < closed - 1.0)]  # fmt: skip
    left += [f"pid {p} started by the lab" for p in doc["pids"] if alive(p)]
    return left


def host_qdiscs() -> str:
    return subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout


def lab_pids(workdir: Path) -> list[int]:
    path = workdir / "lab.json"
    return json.loads(path.read_text())["pids"] if path.exists() else []

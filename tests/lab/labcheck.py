"""Checks that a lab left nothing behind, from the `lab.json` it wrote."""

from __future__ import annotations

import json
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


def leftovers(workdir: Path) -> list[str]:
    """Namespaces, processes and qdiscs of the lab that wrote `workdir/lab.json`."""
    doc = json.loads((workdir / "lab.json").read_text())
    names = set(doc["namespaces"])
    left = [f"namespace {n}" for n in netns.existing(doc["prefix"]) if n in names]
    inside = netns.processes_in(set(doc["namespaces"].values()))
    left += [f"pid {p} inside a lab namespace" for p in inside if alive(p)]
    left += [f"pid {p} started by the lab" for p in doc["pids"] if alive(p)]
    return left


def host_qdiscs() -> str:
    return subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout


def lab_pids(workdir: Path) -> list[int]:
    path = workdir / "lab.json"
    return json.loads(path.read_text())["pids"] if path.exists() else []

"""A loopback launcher for the baseline tests that remembers what it started."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from fedring.bench.launch import local_launch


class RecordingLaunch:
    """`local_launch` that records each node it started, optionally bending one argv."""

    def __init__(self, bend: dict[str, tuple[str, str]] | None = None) -> None:
        self.bend = bend or {}  # node -> (argument, replacement)
        self.nodes: list[str] = []

    def __call__(
        self, node: str, argv: list[str], log: Path, env: Mapping[str, str]
    ) -> subprocess.Popen[bytes]:
        if node in self.bend:
            old, new = self.bend[node]
            argv = [new if a == old else a for a in argv]
        self.nodes.append(node)
        return local_launch(node, argv, log, env)


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line or environment contains `text`.

    Every process a baseline starts, and all that they start (Flower's SuperExec
    leaves its parent's session), carry the run's output directory in an argument
    or in an inherited variable (FLWR_HOME), so this finds leftovers of any session.
    """
    found = []
    needle = text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            blob = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if state != "Z" and needle in blob:
            found.append(int(entry.name))
    return found

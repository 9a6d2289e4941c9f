"""Which machine an agent runs on, and how many cores it may use: what the coordinator
needs to see that members share a CPU (`Probe.share`, `Fleet.cost_probes`).

The host is named by a hash, not by its hostname: the hello is retained on the broker,
and the coordinator needs only to tell machines apart. Linux's machine id is the same
for every process of a machine, network namespaces included (the edge lab's agents);
elsewhere the hostname stands in. Two containers on one machine each have their own,
so they count as two hosts: the cost model then prices each member's CPU as its own,
as it did before it knew hosts.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


def host_id() -> str:
    """16 hex digits that are the same for every agent on this machine."""
    name = ""
    for path in MACHINE_ID_FILES:
        try:
            name = path.read_text(encoding="ascii", errors="replace").strip()
        except OSError:
            continue
        if name:
            break
    name = name or platform.node()
    return hashlib.sha256(f"fedring-host:{name}".encode()).hexdigest()[:16]


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return max(os.cpu_count() or 1, 1)

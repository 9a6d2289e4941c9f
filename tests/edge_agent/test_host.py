"""An agent's host id and cores (`edge_agent.host`): what tells the coordinator that
members share a CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedring.edge_agent import host


def test_the_host_id_is_a_hash_of_the_machine_id_the_same_in_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    ident = tmp_path / "machine-id"
    ident.write_text("3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    monkeypatch.setattr(host, "MACHINE_ID_FILES", (tmp_path / "absent", ident))
    first = host.host_id()
    assert re.fullmatch(r"[0-9a-f]{16}", first) and first == host.host_id()
    assert "3d1219c7" not in first  # the machine id itself is not sent
    ident.write_text("another machine\n")
    assert host.host_id() != first


def test_without_a_machine_id_the_hostname_names_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    empty = tmp_path / "machine-id"
    empty.write_text("\n")
    monkeypatch.setattr(host, "MACHINE_ID_FILES", (empty,))
    monkeypatch.setattr(host.platform, "node", lambda: "board-7")
    seven = host.host_id()
    monkeypatch.setattr(host.platform, "node", lambda: "board-8")
    assert re.fullmatch(r"[0-9a-f]{16}", seven) and host.host_id() != seven


def test_the_cores_are_the_processs_affinity_not_the_machines() -> None:
    """A process pinned to one core (`taskset`, a container's cpuset) may use one,
    whatever the machine has: a child pinned to core 0 says 1."""
    code = ("import os; from fedring.edge_agent.host import usable_cores; "
            "os.sched_setaffinity(0, {0}); print(usable_cores())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == "1"
    assert host.usable_cores() == len(os.sched_getaffinity(0)) >= 1

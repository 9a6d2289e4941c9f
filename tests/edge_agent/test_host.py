"""An agent's host id and cores (`edge_agent.host`): what tells the coordinator that
members share a CPU."""

from __future__ import annotations

import os
import re
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


def test_the_cores_are_the_processs_affinity() -> None:
    assert host.usable_cores() == len(os.sched_getaffinity(0)) >= 1

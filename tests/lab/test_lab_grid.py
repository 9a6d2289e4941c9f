"""`fedring bench grid`: its report arithmetic, the packet delay line, and one small grid
run end to end in a lab (real Mosquitto, agents, gloo) that leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedring.bench import lab_grid
from fedring.bench.lab_grid_report import pace_vs_best, seconds, speedup
from fedring.lab.delayline import packet_delay
from fedring.lab.lab import Lab
from tests.lab.labcheck import leftovers
from tests.lab.test_lab import pytestmark as lab_only


def _run(method: str, secs: float | None, applied: bool = True) -> dict[str, Any]:
    return {"method": method, "seconds_to_target": secs, "cap_s": 60.0, "best_accuracy": 0.9,
            "error": "", "curve": [(1.0, 0.9)], "delay_applied": applied}  # fmt: skip


def test_speedups_are_bounds_where_a_run_was_capped() -> None:
    mine = _run("auto", 6.0)
    assert speedup(mine, _run("ddp", 30.0)) == "5.0×"
    assert speedup(mine, _run("flower", None)) == "> 10.0×"
    assert speedup(mine, _run("ddp", 30.0, applied=False)) == "5.0×†"
    assert speedup(_run("auto", None), _run("ddp", 30.0)) == "< 0.50×"
    assert speedup(_run("auto", None), _run("ddp", None)) == "–"
    assert seconds(_run("flower", None)) == "> 60 (0.900)"


def test_the_pace_of_a_run_is_its_median_round_and_auto_is_judged_on_it() -> None:
    rows = [{"round": r, "wall_s": w} for r, w in enumerate([1.0, 1.01, 1.03, 1.04, 2.0], 1)]
    rows.insert(2, {"round": 2, "accuracy": 0.5})  # a row without a wall time is skipped
    assert lab_grid.round_ms(rows) == 15.0  # gaps 10, 20, 10, 960 ms: the median
    assert lab_grid.round_ms(rows[:1]) is None
    runs = {"ring": {"round_ms": 20.0}, "fanout": {"round_ms": 10.0}, "auto": {"round_ms": 11.0}}
    assert pace_vs_best(runs) == "1.10"
    assert pace_vs_best({"ring": {"round_ms": None}, "auto": {"round_ms": 11.0}}) == "–"


def test_models_and_methods_are_checked_at_the_edge() -> None:
    assert lab_grid.parse_model("mlp1024") == lab_grid.Model("digits", "mlp:1024x1024", 0.95)
    assert lab_grid.parse_model("mnist1d/cnn").target == 0.85
    with pytest.raises(lab_grid.GridError, match="cifar"):
        lab_grid.parse_model("cifar/cnn")
    with pytest.raises(lab_grid.GridError, match="gossip"):
        lab_grid.check_methods(["ring", "gossip"])


_CONNECT = """import socket, sys, time
t = time.perf_counter(); socket.create_connection((sys.argv[1], 5998), timeout=5).close()
print(time.perf_counter() - t)"""
_LISTEN = """import socket
s = socket.socket(); s.bind(("0.0.0.0", 5998)); s.listen(4); print("ready", flush=True)
while True: s.accept()[0].close()"""


@lab_only
def test_the_packet_delay_line_holds_agent_to_agent_traffic(
    make_lab: Callable[..., Lab], tmp_path: Path
) -> None:
    lab = make_lab(2, 50.0, delay_ms=25.0)
    listener = lab.launch("a1", [sys.executable, "-u", "-c", _LISTEN], tmp_path / "listen.log")
    deadline = time.monotonic() + 20
    while "ready" not in (tmp_path / "listen.log").read_text():
        assert time.monotonic() < deadline and listener.poll() is None

    def handshake() -> float:
        argv = [*lab.net.exec("a0"), sys.executable, "-c", _CONNECT, lab.host("a1")]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        return float(done.stdout)

    assert handshake() < 0.025  # the proxy delays MQTT only: no delay between agents
    with packet_delay(lab, tmp_path / "line") as applied:
        assert applied
        # a SYN and its SYN-ACK each cross two agent links, 25 ms each way on each
        assert 0.100 <= handshake() < 0.5
    assert handshake() < 0.025  # the bridge is back as it was


@lab_only
def test_one_small_grid_runs_end_to_end_and_leaves_nothing(tmp_path: Path) -> None:
    model = lab_grid.parse_model("digits/mlp")
    doc = lab_grid.run((model,), (50.0,), (20.0,), (2,), ("fanout", "ddp"), cap_s=4.0,
                       out=tmp_path, timeout_s=120.0)  # fmt: skip
    runs = {r["method"]: r for r in doc["runs"]}
    assert sorted(runs) == ["ddp", "fanout"]
    for r in runs.values():
        assert r["error"] == "", r
        assert r["curve"] and r["delay_applied"]
        assert r["seconds_to_target"] is not None or r["best_accuracy"] > 0
        assert r["bytes_sent_per_agent"] > 10_000
    saved = json.loads((tmp_path / "grid.json").read_text())
    assert len(saved["runs"]) == 2 and saved["not_run"] == []
    paced = next(r for r in saved["runs"] if r["method"] == "fanout")
    assert paced["round_ms"] == runs["fanout"]["round_ms"] > 0
    paced["round_ms"] = None  # a grid run before the field: re-read from the job's rows
    lab_grid.fill_round_ms(saved, tmp_path)
    assert paced["round_ms"] == runs["fanout"]["round_ms"]
    table = (tmp_path / "grid.md").read_text()
    assert "| 2 | digits/mlp (17,226) | 50 | 20 |" in table
    assert (tmp_path / "grid.png").stat().st_size > 10_000
    assert leftovers(tmp_path / "n2") == []

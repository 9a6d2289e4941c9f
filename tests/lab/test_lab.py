"""The edge lab on this machine: shaped links, a job over Mosquitto, and teardown
after success, after an exception, on SIGTERM, and by `fedring lab clean`."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.lab import netns
from fedring.lab.impair import loss_unsupported
from fedring.lab.lab import Lab
from fedring.transport.mosquitto import MosquittoMissing, mosquitto_binary
from tests.lab.labcheck import host_qdiscs, lab_pids, leftovers
from tests.mqtt.conftest import wait_for


def _why_not() -> str | None:
    try:
        mosquitto_binary()
    except MosquittoMissing as exc:
        return str(exc)
    return netns.can_build()


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=f"no lab here: {_why_not()}")

SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5999)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    t0 = t0 or time.monotonic(); n += len(b)
print(n * 8 / (time.monotonic() - t0) / 1e6, flush=True)
"""
SEND = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5999), 5); c.sendall(b"x" * 3_000_000); c.close()
"""


def _mbps(lab: Lab, src: str, dst: str) -> float:
    sink = subprocess.Popen([*lab.net.exec(dst), sys.executable, "-c", SINK],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
    subprocess.run([*lab.net.exec(src), sys.executable, "-c", SEND, lab.host(dst)],
                   check=True, timeout=30)  # fmt: skip
    out, _ = sink.communicate(timeout=30)
    return float(out.strip())


def test_each_link_is_shaped_both_ways(tmp_path: Path) -> None:
    qdiscs_before = host_qdiscs()
    with Lab(2, 10.0, downlink_mbps=20.0, workdir=tmp_path) as lab:
        assert "tbf" in netns.qdiscs(lab.net, "a0") and "rate 10Mbit" in netns.qdiscs(lab.net, "a0")
        up, down = _mbps(lab, "a1", "hub"), _mbps(lab, "hub", "a1")
        between = _mbps(lab, "a0", "a1")  # through both shapers: the slower wins
    assert 8.0 < up <= 10.5, up
    assert 16.0 < down <= 21.0, down
    assert 8.0 < between <= 10.5, between
    assert leftovers(tmp_path) == []
    assert host_qdiscs() == qdiscs_before  # nothing was shaped outside the lab


def test_a_job_runs_over_the_labs_broker(make_lab: Callable[..., Lab]) -> None:
    spec = JobSpec(agents=3, rounds=60, eval_every=20, checkpoint_every=20, timeout_s=30.0)
    lab = make_lab(3, 50.0)  # the fixture checks that nothing is left afterwards
    lab.start_agents()
    result = lab.run_job(spec, timeout_s=300)
    summary = result["summary"]
    assert summary["identical_models"] and summary["rounds"] == 60
    assert summary["final_accuracy"] > 0.8
    walls = [row["wall_s"] for row in result["rows"]]
    assert walls == sorted(walls) and len(walls) == 60
    for i in range(3):  # the kernel saw at least what fedring counted as ring frames
        sent, received = result["link_bytes"][f"a{i}"]
        assert sent >= summary["agent_bytes"][f"lab-{i}"]["link"] > 0 and received > 0


def _agents_ready(workdir: Path, n: int) -> bool:
    logs = [workdir / f"agent-{i}.log" for i in range(n)]
    return all(log.exists() and "ready on" in log.read_text(errors="replace") for log in logs)


def test_an_exception_inside_the_lab_tears_it_down(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from fedring.lab.lab import Lab
        with Lab(2, 10.0, workdir=Path({str(tmp_path)!r})) as lab:
            lab.start_agents()
            time.sleep(1.0)
            raise RuntimeError("boom")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 1 and "boom" in done.stderr
    assert len(lab_pids(tmp_path)) == 3  # the broker and two agents were running
    assert leftovers(tmp_path) == []


def test_sigterm_to_a_running_lab_tears_it_down(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedring", "lab", "run", "--agents", "2", "--rounds", "100000",
         "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:  # broker, two agents and the coordinator, with training under way
        wait_for(lambda: len(lab_pids(tmp_path)) == 4 and _agents_ready(tmp_path, 2), 120,
                  "the lab to run")  # fmt: skip
        time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert leftovers(tmp_path) == []


def test_lab_clean_removes_what_a_killed_lab_left(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from fedring.lab.lab import Lab
        lab = Lab(2, 10.0, workdir=Path({str(tmp_path)!r})).__enter__()
        lab.start_agents()
        print("up", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        wait_for(lambda: _agents_ready(tmp_path, 2), 120, "the agents")
    finally:
        proc.kill()  # SIGKILL: no teardown runs
        proc.wait()
    assert leftovers(tmp_path)  # the orphaned namespaces and processes are still there
    done = subprocess.run([sys.executable, "-m", "fedring", "lab", "clean"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "removed" in done.stdout
    assert leftovers(tmp_path) == []


def test_bad_bandwidth_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    lab = Lab(1, -1.0, workdir=tmp_path)
    with pytest.raises(ValueError, match=r"bandwidth=-1.0 Mbit/s must be in"):
        lab.__enter__()
    assert not any(n.startswith(lab.net.prefix) for n in netns.existing())


@pytest.mark.skipif(bool(loss_unsupported()), reason=f"no nftables: {loss_unsupported()}")
def test_loss_and_delay_reach_the_agents_links(make_lab: Callable[..., Lab]) -> None:
    spec = JobSpec(agents=2, rounds=30, eval_every=10, checkpoint_every=10, timeout_s=30.0)
    lab = make_lab(2, 50.0, loss=0.05, delay_ms=30.0)
    lab.start_agents()
    result = lab.run_job(spec, timeout_s=300)
    dropped = lab.dropped()
    assert result["summary"]["identical_models"] and result["summary"]["rounds"] == 30
    assert all(n > 0 for n in dropped.values()) and len(dropped) == 2, dropped
    # every ring step crosses two proxies (sender to broker, broker to receiver): >= 60 ms,
    # and a round of 2 agents has 2 steps
    per_round = result["rows"][-1]["wall_s"] / 30
    assert per_round >= 0.12, per_round


def test_the_labs_processes_run_this_fedring_not_the_working_directorys(
    make_lab: Callable[..., Lab], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m fedring` puts its working directory first on sys.path: a ``fedring/``
    folder there (another checkout, an old copy) would run in the lab's agents while
    the caller ran this one."""
    import fedring

    impostor = tmp_path / "cwd"
    (impostor / "fedring").mkdir(parents=True)
    (impostor / "fedring" / "__init__.py").write_text("")
    monkeypatch.chdir(impostor)
    lab = make_lab(1, 50.0)
    log = tmp_path / "which.log"
    proc = lab.launch("a0", [sys.executable, "-c", "import fedring; print(fedring.__file__)"], log)
    assert proc.wait(30) == 0, log.read_text()
    assert log.read_text().strip() == fedring.__file__

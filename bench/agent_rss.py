"""Resident memory of a `fedring agent` per board profile, idle and while training.

For each profile, two agent daemons (``--profile NAME``: its torch threads) join a
Mosquitto on loopback; the coordinator runs each default job on them (digits MLP,
MNIST-1D CNN). Agent 0's ``/proc/PID/status`` is read: VmRSS once it has said
hello (idle: interpreter, torch, fedring) and VmHWM at the end (the peak while
loading the data and training). The table sets the peak beside the profile's
budget for the agent process (``ram_budget_mb`` + the 220 MB runtime allowance,
`firmware_profiles.apply.check_budget`). Measured on this machine's CPU (x86_64);
on a board the runtime differs with its torch build (docs/fleet.md).

    python bench/agent_rss.py [--profiles rpi-zero-2w rpi4-4gb ...] [--rounds 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedring.firmware_profiles.apply import RUNTIME_MB
from fedring.firmware_profiles.schema import load_builtin
from fedring.transport.mosquitto import Mosquitto

JOBS = {"digits mlp": ("digits", "mlp"), "mnist1d cnn": ("mnist1d", "cnn")}
PROFILES = ["rpi-zero-2w", "rpi3b-plus", "rpi4-4gb", "rpi5", "jetson-orin-nano", "generic-x86_64"]


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def wait_for_hello(log: Path, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if log.exists() and " ready on " in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"no 'ready' in {log} within {deadline_s} s")


def measure(url: str, tmp: Path, profile: str, dataset: str, model: str, rounds: int) -> dict:
    job = tmp / f"{profile}-{dataset}.toml"
    job.write_text(f'[job]\nagents = 2\ndataset = "{dataset}"\nmodel = "{model}"\n'
                   f"rounds = {rounds}\neval_every = {rounds}\nseed = 0\n")  # fmt: skip
    agents = []
    for i in range(2):
        log = tmp / f"{profile}-{dataset}-a{i}.log"
        cmd = [sys.executable, "-m", "fedring", "-v", "agent", "--broker", url,
               "--id", f"{profile}-{dataset}-{i}", "--profile", profile]  # fmt: skip
        with open(log, "wb") as out:
            agents.append((subprocess.Popen(cmd, stdout=out, stderr=out), log))
    try:
        for _, log in agents:
            wait_for_hello(log)
        pid = agents[0][0].pid
        idle = status_kb(pid, "VmRSS")
        out = tmp / f"run-{profile}-{dataset}"
        run = subprocess.run(
            [sys.executable, "-m", "fedring", "coordinator", "run", str(job), "--broker", url,
             "--out", str(out), "--json", "--enrol-timeout", "60"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        peak = status_kb(pid, "VmHWM")
        summary = json.loads(run.stdout) if run.returncode == 0 else {}
        why = [line.split("refused the job: ", 1)[1] for line in
               agents[0][1].read_text(errors="replace").splitlines() if "refused the job" in line]
        return {"idle_mb": idle / 1024, "peak_mb": peak / 1024, "ok": run.returncode == 0,
                "accuracy": summary.get("final_accuracy"), "refused": why[0] if why else ""}
    finally:
        for proc, _ in agents:
            proc.terminate()
        for proc, _ in agents:
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="+", default=PROFILES)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d, Mosquitto(workdir=Path(d)) as broker:
        for profile in args.profiles:
            p = load_builtin(profile)
            for name, (dataset, model) in JOBS.items():
                got = measure(broker.url, Path(d), profile, dataset, model, args.rounds)
                rows.append({"profile": profile, "threads": p.torch_threads, "job": name,
                             "budget_mb": p.ram_budget_mb + RUNTIME_MB, **got})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| profile | torch threads | job | idle RSS MB | peak RSS MB | agent budget MB "
          "| fits | accuracy |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- | ---: |")
    for r in rows:
        fits = "refused" if r["refused"] else ("yes" if r["peak_mb"] <= r["budget_mb"] else "no")
        acc = f"{r['accuracy']:.4f}" if r["accuracy"] is not None else "-"
        print(f"| {r['profile']} | {r['threads']} | {r['job']} | {r['idle_mb']:.0f} "
              f"| {r['peak_mb']:.0f} | {r['budget_mb']} | {fits} | {acc} |")  # fmt: skip
    for r in rows:
        if r["refused"]:
            print(f"{r['profile']}, {r['job']}: refused: {r['refused']}")


if __name__ == "__main__":
    main()

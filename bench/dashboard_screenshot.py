"""A screenshot of the live dashboard of a real running job (docs/operations/dashboard.png).

A Mosquitto on loopback, four agent daemons and a coordinator with ``--dashboard 0``
run a digits job (group-top-k, density 0.01); one agent is killed (SIGKILL) at round
``--kill-at`` and started again some rounds later, so the events list shows a loss,
a re-formation and its return. Debian's headless Chromium (Playwright) opens the page
and takes the screenshot once the shown round reaches ``--shot-at``; then everything
is stopped by PID.

    python bench/dashboard_screenshot.py [--out docs/operations/dashboard.png]
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fedring.transport.mosquitto import Mosquitto

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update",
        "--disable-sync"]  # fmt: skip
JOB = """[job]
agents = 4
dataset = "digits"
compression = "group-topk"
density = 0.01
rounds = {rounds}
eval_every = 10
seed = 0
timeout_s = 20.0
"""
SHOWN = "() => Number(document.querySelector('#round').dataset.round)"
REACHED = "(n) => Number(document.querySelector('#round').dataset.round) >= n"


def wait_for_text(log: Path, pattern: str, deadline_s: float) -> re.Match[str]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = re.search(pattern, log.read_text(errors="replace")) if log.exists() else None
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"no {pattern!r} in {log} within {deadline_s} s")


def agent(url: str, name: str, tmp: Path) -> subprocess.Popen[bytes]:
    with open(tmp / f"{name}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "fedring", "-v", "agent", "--broker", url,
                                 "--id", name], stdout=log, stderr=log)  # fmt: skip


def shoot(url: str, out: Path, kill_at: int, back_at: int, shot_at: int,
          agents: dict[str, subprocess.Popen[bytes]],
          start: Callable[[str], subprocess.Popen[bytes]]) -> int:  # fmt: skip
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 980})
            page.goto(url)
            page.wait_for_function(REACHED, arg=kill_at, timeout=120_000)
            agents["a3"].send_signal(signal.SIGKILL)
            agents["a3"].wait(10)
            page.wait_for_function(REACHED, arg=back_at, timeout=120_000)
            agents["a3"] = start("a3")
            page.wait_for_function(REACHED, arg=shot_at, timeout=180_000)
            time.sleep(1.5)  # one more poll: the header and the curves show the same round
            page.screenshot(path=str(out))
            return int(page.evaluate(SHOWN))
        finally:
            browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/operations/dashboard.png"))
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--kill-at", type=int, default=60, help="SIGKILL agent a3 at this round")
    ap.add_argument("--back-at", type=int, default=100, help="start a3 again at this round")
    ap.add_argument("--shot-at", type=int, default=220, help="the screenshot at this round")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as name, Mosquitto(workdir=Path(name)) as broker:
        tmp = Path(name)
        (tmp / "job.toml").write_text(JOB.format(rounds=args.rounds))
        agents = {f"a{i}": agent(broker.url, f"a{i}", tmp) for i in range(4)}
        log = tmp / "coordinator.log"
        with open(log, "wb") as err:
            coord = subprocess.Popen(
                [sys.executable, "-m", "fedring", "coordinator", "run", str(tmp / "job.toml"),
                 "--broker", broker.url, "--out", str(tmp / "out"), "--no-onnx", "--quiet",
                 "--dashboard", "0"], stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        try:
            url = wait_for_text(log, r"dashboard at (http://\S+/)", 60).group(1)
            shown = shoot(url, args.out, args.kill_at, args.back_at, args.shot_at, agents,
                          lambda n: agent(broker.url, n, tmp))  # fmt: skip
            print(f"{args.out}: the dashboard at round {shown} of {args.rounds} ({url})")
        except Exception:
            for name in ("coordinator", "a0"):
                tail = (tmp / f"{name}.log").read_text(errors="replace")[-1500:]
                print(f"--- {name}.log, its end:\n{tail}", file=sys.stderr)
            raise
        finally:
            for proc in [coord, *agents.values()]:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in [coord, *agents.values()]:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


if __name__ == "__main__":
    main()

"""Fleet scale: N protocol agents against one Mosquitto and a real coordinator (issue 29).

For every scenario (star, sampling, async; ring where asked) and every N, a fresh
Mosquitto on loopback, a real ``fedring coordinator run`` process and N torch-free
protocol agents in this process (`fedring.lab.loadgen`): enrolment time (first hello
to the last manifest acknowledged), the coordinator's CPU seconds over enrolment and
per round, its peak resident memory, the broker's CPU per round, then the cost
against N fitted linear and quadratic (`fedring.lab.loadgen_report`) and projected
to 10,000 boards. Enrolment at 1,000 agents must stay under 60 s.

    python bench/fleet_scale.py                       # N = 30 50 100 300 1000, ~10 min
    python bench/fleet_scale.py --agents 20 50 --modes star --rounds 5
    python bench/fleet_scale.py --repeat 3             # each figure the median of 3 runs
    python bench/fleet_scale.py --agents 8 32 100 --modes ring --rounds 5

A ring round is 2(N-1) exchanges in a row between neighbours, which the coordinator
never sees: its wall time grows with N whatever the machine (a 1,000-member ring
runs 1,998 steps a round), so ``ring`` is not among the default modes; run it at the
N a ring job would really have.

Writes OUT/fleet_scale.json and OUT/fleet_scale.md (default runs/fleet-scale).
The agents run in one event loop on this machine, beside the coordinator and the
broker: on a small machine they compete for the same cores, so a figure is an upper
bound on what each process costs alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from fedring.lab.loadgen_report import fit_table, fits, median_row, table
from fedring.lab.loadgen_run import SCENARIOS, run_scenario

ENROL_LIMIT_S = 60.0
DEFAULT_MODES = tuple(m for m in SCENARIOS if m != "ring")  # see above: --modes ring


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, nargs="+", default=[30, 50, 100, 300, 1000])
    ap.add_argument("--modes", nargs="+", choices=SCENARIOS, default=list(DEFAULT_MODES))
    ap.add_argument("--rounds", type=int, default=20, help="star rounds (async: 2 per agent)")
    ap.add_argument("--out", type=Path, default=Path("runs/fleet-scale"))
    ap.add_argument("--presence", choices=("peers", "all", "none"), default="peers",
                    help="whose status agents subscribe to: the coordinator's and their "
                         "peers' (as real agents), every agent's (real ones before issue "
                         "29), none")  # fmt: skip
    ap.add_argument("--no-presence", action="store_true", help="the same as --presence none")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each scenario and N; the table takes each figure's "
                         "median (a loaded machine's noise hides or fakes curvature)")  # fmt: skip
    args = ap.parse_args()
    presence = "none" if args.no_presence else args.presence
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: must be 1 or more")
    rows, loads = [], os.getloadavg()
    for mode in args.modes:
        for n in sorted(args.agents):
            started = time.monotonic()
            runs = [run_scenario(mode, n, args.rounds, args.out / f"{mode}-{n}-{i}",
                                 presence=presence) for i in range(args.repeat)]  # fmt: skip
            row = median_row(runs) if args.repeat > 1 else runs[0]
            row["load_avg_1min"] = round(os.getloadavg()[0], 2)  # the machine is shared
            rows.append(row)
            print(f"{mode:8} N={n:5}: enrol {row['enrol_s']} s, coordinator "
                  f"{row['coordinator_cpu_rounds_s']} s CPU over {row['rounds']} rounds, "
                  f"broker {row['broker_cpu_rounds_s']} s, RSS {row['coordinator_rss_mb']} MB, "
                  f"{row['loadgen']['statuses_heard']} statuses heard by the agents, load "
                  f"{row['load_avg_1min']}"
                  f"{_ring_line(row)} ({time.monotonic() - started:.0f} s)", file=sys.stderr,
                  flush=True)  # fmt: skip
    found = fits(rows)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, load average "
               f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min) at the end, "
               f"{' '.join(f'{x:.1f}' for x in loads)} at the start")  # fmt: skip
    result = {"machine": machine, "presence": presence, "repeat": args.repeat, "rows": rows,
              "fits": found}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fleet_scale.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    md = f"Machine: {machine}.\n\n{table(rows)}\n\nFits against N:\n\n{fit_table(found)}\n"
    (args.out / "fleet_scale.md").write_text(md)
    print(md)
    slow = [r for r in rows if r["agents"] >= 1000 and (r["enrol_s"] or 1e9) >= ENROL_LIMIT_S]
    for r in slow:
        print(f"enrolment of {r['agents']} agents ({r['mode']}) took {r['enrol_s']} s "
              f">= {ENROL_LIMIT_S:g} s", file=sys.stderr)  # fmt: skip
    return 1 if slow else 0


def _ring_line(row: dict[str, Any]) -> str:
    """A ring's round and step times (2(N-1) steps a round), and its refused frames."""
    if row["mode"] != "ring":
        return ""
    gen = row.get("loadgen") or {}
    if "ring_frames_sent" not in gen:  # every agent refused the ring: nothing to time
        return ", no ring ran (every agent refused it)"
    n, rounds = row["agents"], max(row["rounds"], 1)
    per_round = row["train_s"] / rounds
    return (f", {1000 * per_round:.0f} ms a round, {1000 * per_round / max(2 * (n - 1), 1):.1f}"
            f" ms a step, {gen['ring_frames_sent']} ring frames, the agents' CPU "
            f"{row['loadgen_cpu_rounds_s']} s, {gen.get('refused_frames', 0)} refused")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

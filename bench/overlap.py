"""Sync rounds with and without overlap (`bucket_kb`) over links of a given bandwidth.

N members run the engine's loop (`engine.loop.run`, each a `Member` from
`build.member`) on threads of this process, each behind a shaped link: a send
holds the sender's link for ``latency + bytes / bandwidth`` seconds (a sleep, so
the CPU stays free for backward, as on a real NIC). The same job runs without
and with overlap, `--repeats` times each, interleaved; the table prints the
median seconds per round of compute (forward and backward), communication and
the whole step, and the overlapped step divided by max(compute, communication)
of the run without overlap: the acceptance target is at most 1.1 where the two
are comparable.

Agents here share this machine's cores and one interpreter lock; on a small or
busy machine the numbers swing by tens of percent. On boards, read the same
three numbers from the rows of metrics.jsonl.

    python bench/overlap.py [--agents 2] [--model cnn] [--mbit 40] [--bucket-kb 16]
                            [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fedring import build
from fedring.collective.channel import PeerChannel
from fedring.config import JobSpec
from fedring.engine.group import Group
from fedring.engine.loop import run as run_loop
from fedring.sim.runner import prepare_model
from fedring.transport.base import Deadline, Delivery, MembershipEvent
from fedring.transport.inproc import InprocEndpoint, InprocTransport

TIMES = ("compute_s", "comm_s", "step_s")


class ShapedEndpoint:
    """An in-process endpoint whose sends take as long as on a link of `bps` bits/s."""

    def __init__(self, inner: InprocEndpoint, bps: float, latency_s: float) -> None:
        self.inner, self.name, self.stats = inner, inner.name, inner.stats
        self.bps, self.latency_s = bps, latency_s
        self._link = threading.Lock()  # one frame on the wire at a time

    def send(self, dst: str, data: bytes, deadline: Deadline) -> None:
        with self._link:
            time.sleep(self.latency_s + 8 * len(data) / self.bps)
        self.inner.send(dst, data, deadline)

    def recv(self, deadline: Deadline) -> Delivery | MembershipEvent:
        return self.inner.recv(deadline)

    def peers(self) -> frozenset[str]:
        return self.inner.peers()

    def close(self) -> None:
        self.inner.close()


def run_job(spec: JobSpec, bps: float, latency_s: float) -> dict[str, float]:
    """Median seconds per round (after the first few: warm-up) of one shaped job;
    medians, since agents that share a small machine's cores make outliers."""
    p = build.plan(spec)
    prepared = [prepare_model(spec, p, r) for r in range(spec.agents)]
    hub = InprocTransport()
    names = tuple(f"agent-{i}" for i in range(spec.agents))
    endpoints = [ShapedEndpoint(hub.connect(n), bps, latency_s) for n in names]
    loop = build.loop_settings(spec)

    def agent(rank: int) -> list[dict[str, Any]]:
        channel = PeerChannel(endpoints[rank], "bench")
        group = Group(channel, names, spec.topology, spec.timeout_s)
        member = build.member(spec, p.task, p.dataset, *prepared[rank], group, rank=rank,
                              weight=p.weights[rank])  # fmt: skip
        try:
            return run_loop(member, loop).rows
        except BaseException:
            endpoints[rank].close()  # the neighbours fail fast instead of waiting
            raise
        finally:
            member.state.optimizer.close()

    with ThreadPoolExecutor(spec.agents) as pool:
        rows = [r for f in [pool.submit(agent, i) for i in range(spec.agents)] for r in f.result()]
    timed = [r for r in rows if r["round"] > 3]
    out = {k: statistics.median(r[k] for r in timed) for k in TIMES}
    out["bytes_per_round"] = rows[-1]["bytes_sent"] / rows[-1]["round"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # one core per agent thread, as on a board
    spec = JobSpec(agents=args.agents, dataset=args.dataset, model=args.model,
                   compression=args.compression, batch_size=args.batch_size,
                   rounds=args.rounds, eval_every=args.rounds, timeout_s=60.0)  # fmt: skip
    bps, latency = args.mbit * 1e6, args.latency_ms / 1000
    runs: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    for _ in range(args.repeats):  # interleaved, so a busy spell hits both alike
        runs["without"].append(run_job(spec, bps, latency))
        runs["with"].append(run_job(spec.replace(bucket_kb=args.bucket_kb), bps, latency))
    plain, over = ({k: statistics.median(r[k] for r in rs) for k in rs[0]} for rs in runs.values())
    bound = max(plain["compute_s"], plain["comm_s"])
    return {"spec": {k: getattr(spec, k) for k in ("agents", "dataset", "model", "compression",
                                                    "batch_size", "rounds")},
            "mbit": args.mbit, "latency_ms": args.latency_ms, "bucket_kb": args.bucket_kb,
            "without": plain, "with": over, "step_over_max": over["step_s"] / bound}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--compression", default="none")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--mbit", type=float, default=50.0, help="link bandwidth, Mbit/s")
    ap.add_argument("--latency-ms", type=float, default=1.0, help="per frame")
    ap.add_argument("--bucket-kb", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each; medians reported")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run(args)
    if args.json:
        print(json.dumps(r, sort_keys=True))
        return
    print(f"{r['spec']}, {r['mbit']} Mbit/s, {r['latency_ms']} ms/frame")
    print(f"{'':22} {'compute ms':>10} {'comm ms':>10} {'step ms':>10} {'B/round':>10}")
    for name, key in (("without overlap", "without"), (f"bucket_kb={r['bucket_kb']}", "with")):
        t = r[key]
        print(f"{name:22} {t['compute_s'] * 1e3:>10.1f} {t['comm_s'] * 1e3:>10.1f} "
              f"{t['step_s'] * 1e3:>10.1f} {t['bytes_per_round']:>10,.0f}")  # fmt: skip
    print(f"overlapped step / max(compute, comm) without: {r['step_over_max']:.2f} (target <= 1.1)")


if __name__ == "__main__":
    main()

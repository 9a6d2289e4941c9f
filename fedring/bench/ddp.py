"""Baseline: PyTorch DistributedDataParallel over gloo, dense, one process per node.

What it is: the textbook data-parallel run that fedring's dense sync ring reproduces
over MQTT, so time-to-accuracy on the same links compares the transports alone. Each
rank holds fedring's iid shard ``make_shards(y_train, N, "iid", seed)[rank]``, the
same initial model (`build_model(model, ..., seed)`) and fedring's batch order
(`ShardSampler`, seeded by ``(seed, rank)``). DDP averages the gradients
with gloo's ring all-reduce (dense fp32), then ``torch.optim.SGD(momentum=0.9)``
steps, which is exactly what fedring's runners wrap (v <- m v + g; p <- p - lr v).

Configuration: the learning rate is fedring's dense sync schedule, taken from
`build.lr_schedule(JobSpec(agents=N, compression="none"))`: base 0.025 per 32-sample
batch, scaled linearly by N, reached after a 50-step warm-up. Batch 32 per rank.
Every `eval_every` steps rank 0 evaluates on the test set, appends
``{"round", "t", "accuracy", "test_loss"}`` to ``OUT/metrics.jsonl`` and broadcasts
whether the target is reached, so all ranks stop at the same step.

Outputs: ``OUT/metrics.jsonl``, ``OUT/summary.json`` (rank 0) and ``OUT/rank{R}.json``
with the bytes the rank sent and received: the kernel's counters of ``--iface``
(read before and after training; they count everything on that interface, so give
each rank a namespace of its own) or, without ``--iface``, the analytic ring
all-reduce figure 2 (N-1)/N x params x 4 bytes per step, labelled ``"analytic"``.

    python -m fedring.bench.ddp --rank 0 --world 4 --master 10.0.0.1:29500 --out OUT

`run_ddp` starts the N workers through a `fedring.bench.launch.Launch`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from fedring.bench.launch import (
    BaselineError,
    Host,
    Launch,
    agent_nodes,
    exit_past_gloo_teardown,
    stop_all,
)
from fedring.bench.powersgd import register_powersgd
from fedring.bench.sessions import free_port
from fedring.build import lr_schedule
from fedring.config import JobSpec
from fedring.engine.sampler import ShardSampler
from fedring.engine.task import ClassificationTask
from fedring.training.datasets import Dataset, load_dataset
from fedring.training.models import build_model, param_count
from fedring.training.sharding import make_shards, shard_data


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedring.bench.ddp", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous store")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--model", default="mlp")
    p.add_argument("--rounds", type=int, default=600, help="optimizer steps at most")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--target", type=float, default=0.95, help="stop at this test accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iface", default=None, help="count bytes on it; gloo uses it")
    p.add_argument("--connect-timeout", type=float, default=60.0, help="seconds")
    p.add_argument(
        "--cap-s",
        type=float,
        default=0.0,
        help="stop after this many seconds of training (checked at evaluations; 0 = no cap)",
    )
    p.add_argument(
        "--powersgd-rank",
        type=int,
        default=0,
        help="torch's PowerSGD hook of this matrix rank (0 = plain DDP)",
    )
    p.add_argument("--powersgd-start", type=int, default=10, help="dense steps before PowerSGD")
    return p


def iface_bytes(iface: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) the kernel counted on `iface` so far."""
    stats = Path("/sys/class/net") / iface / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


@dataclass
class Outcome:
    """Where a rank's training loop ended."""

    steps: int = 0
    accuracy: float = 0.0  # rank 0's last evaluation
    seconds_to_target: float | None = None
    wall_seconds: float = 0.0


def worker(args: argparse.Namespace) -> None:
    """One rank: build fedring's task, rendezvous, train, write the outputs."""
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface  # read when the gloo group is made
    torch.set_num_threads(1)  # many processes on a few cores
    spec = JobSpec(agents=args.world, dataset=args.dataset, model=args.model,
                   compression="none", rounds=args.rounds, eval_every=args.eval_every,
                   seed=args.seed)  # fmt: skip
    ds = load_dataset(spec.dataset, spec.seed)
    shard = make_shards(ds.y_train.numpy(), args.world, spec.sharding, spec.seed)[args.rank]
    x, y = shard_data(ds, shard)
    model = build_model(spec.model, ds.feature_shape, ds.num_classes, spec.seed)
    # fedring's batch order and evaluation; DDP and SGD do the steps.
    sampler = ShardSampler(len(x), batch_size=spec.batch_size, seed=spec.seed, rank=args.rank)
    trainer = _Shard(model, x, y, sampler)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world,
                            timeout=timedelta(seconds=args.connect_timeout))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    before = iface_bytes(args.iface) if args.iface else (0, 0)
    outcome = _train(args, spec, trainer, ds)
    after = iface_bytes(args.iface) if args.iface else (0, 0)
    dist.barrier()
    params = param_count(model)
    if args.iface:
        traffic = {"source": f"kernel:{args.iface}", "tx_bytes": after[0] - before[0],
                   "rx_bytes": after[1] - before[1]}  # fmt: skip
    else:
        ring = int(2 * (args.world - 1) / args.world * params * 4 * outcome.steps)
        traffic = {"source": "analytic", "tx_bytes": ring, "rx_bytes": ring}
    (args.out / f"rank{args.rank}.json").write_text(json.dumps({"rank": args.rank, **traffic}))
    if args.rank == 0:
        _write_summary(args, spec, outcome, params)
    dist.destroy_process_group()


@dataclass
class _Shard:
    """This rank's model, shard and seeded batches."""

    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    sampler: ShardSampler

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(self.sampler.next_batch())
        return self.x[idx], self.y[idx]


def _train(args: argparse.Namespace, spec: JobSpec, trainer: _Shard, ds: Dataset) -> Outcome:
    """DDP steps with fedring's lr schedule until the target (all ranks agree) or `rounds`."""
    sched = lr_schedule(spec)
    # PowerSGD waits on gloo inside gloo's callbacks: with two buckets (DDP's default
    # first bucket is 1 MiB) both of gloo's worker threads block and the first
    # compressed step hangs (mlp:512x512, 4 ranks). An explicit cap makes one bucket.
    ddp = DistributedDataParallel(trainer.model, bucket_cap_mb=25 if args.powersgd_rank else None)
    if args.powersgd_rank:
        register_powersgd(ddp, args.world, rank=args.powersgd_rank,
                          start_iter=args.powersgd_start, seed=args.seed)  # fmt: skip
    opt = torch.optim.SGD(ddp.parameters(), lr=sched.lr_at(0), momentum=spec.momentum)
    metrics = args.out / "metrics.jsonl"
    if args.rank == 0:
        metrics.write_text("")
    stop = torch.zeros(1)
    outcome, start = Outcome(), time.perf_counter()
    for step in range(1, args.rounds + 1):
        outcome.steps = step
        xb, yb = trainer.next_batch()
        for group in opt.param_groups:
            group["lr"] = sched.lr_at(step - 1)
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(ddp(xb), yb).backward()  # the gradient all-reduce runs in here
        opt.step()
        if step % args.eval_every and step != args.rounds:
            continue
        if args.rank == 0:
            test_loss, outcome.accuracy = ClassificationTask().evaluate(trainer.model, ds)
            t = time.perf_counter() - start
            row = {"round": step, "t": t, "accuracy": outcome.accuracy, "test_loss": test_loss}
            with metrics.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if outcome.accuracy >= args.target:
                outcome.seconds_to_target = t
                stop.fill_(1.0)
            elif args.cap_s and t >= args.cap_s:
                stop.fill_(1.0)
        dist.broadcast(stop, src=0)  # collective: every rank stops at the same step
        if stop.item():
            break
    outcome.wall_seconds = time.perf_counter() - start
    return outcome


def _write_summary(args: argparse.Namespace, spec: JobSpec, o: Outcome, params: int) -> None:
    sched = lr_schedule(spec)
    summary = {"baseline": "ddp-gloo", "powersgd_rank": args.powersgd_rank, "world": args.world,
               "dataset": spec.dataset,
               "model": spec.model, "final_accuracy": o.accuracy, "rounds": o.steps,
               "target": args.target, "seconds_to_target": o.seconds_to_target,
               "wall_seconds": o.wall_seconds, "params": params, "batch_size": spec.batch_size,
               "lr": {"base": sched.base_lr, "peak": sched.peak_lr,
                      "warmup_steps": sched.warmup_steps},
               "momentum": spec.momentum}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


def run_ddp(
    n: int,
    launch: Launch,
    host: Host,
    *,
    dataset: str = "digits",
    model: str = "mlp",
    rounds: int = 600,
    eval_every: int = 5,
    target: float = 0.95,
    seed: int = 0,
    out: Path,
    iface: str | None = None,
    port: int | None = None,
    connect_timeout_s: float = 60.0,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    cap_s: float = 0.0,
    powersgd_rank: int = 0,
) -> dict[str, Any]:
    """Run the DDP baseline on nodes a0..a{n-1}, rank 0 (the master) on a0.

    Parameters
    ----------
    n : int
        Ranks, one per node.
    launch, host : Launch, Host
        Where processes start and how nodes reach a0 (`fedring.bench.launch`).
    out : Path
        Gets ``metrics.jsonl``, ``summary.json``, ``rank{R}.json`` and ``rank{R}.log``.
    iface : str, optional
        Interface for gloo and the kernel byte counters (``eth0`` in the lab).
    port : int, optional
        Rendezvous port on a0; a free port of this host when not given.
    connect_timeout_s : float
        How long ranks wait for each other at the rendezvous.
    timeout_s : float
        Deadline of the whole run.
    env : Mapping, optional
        Environment of the workers (default: this process's; PYTHONPATH must reach fedring).
    cap_s : float
        Stop at the first evaluation after this many seconds of training (0: no cap).
    powersgd_rank : int
        Register torch's PowerSGD hook of this rank (`fedring.bench.powersgd`); 0: plain DDP.

    Returns
    -------
    dict
        The summary plus ``metrics`` (the rows) and ``ranks`` (bytes per rank).

    Raises
    ------
    BaselineError
        A rank failed or the run passed `timeout_s` (all ranks are stopped first),
        or processes were left behind.
    """
    out.mkdir(parents=True, exist_ok=True)
    master = f"{host('a0')}:{port or free_port()}"
    common = ["--world", str(n), "--master", master, "--dataset", dataset, "--model", model,
              "--rounds", str(rounds), "--eval-every", str(eval_every), "--target", str(target),
              "--seed", str(seed), "--out", str(out),
              "--connect-timeout", str(connect_timeout_s), "--cap-s", str(cap_s),
              "--powersgd-rank", str(powersgd_rank)]  # fmt: skip
    if iface:
        common += ["--iface", iface]
    environ = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, node in enumerate(agent_nodes(n)):
            argv = [sys.executable, "-m", "fedring.bench.ddp", "--rank", str(rank), *common]
            procs.append(launch(node, argv, out / f"rank{rank}.log", environ))
        _wait(procs, out, timeout_s)
    finally:
        left = stop_all(procs)
    if left:
        raise BaselineError(f"ddp: processes {left} still alive after SIGKILL")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["metrics"] = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    summary["ranks"] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    return summary


def _wait(procs: list[subprocess.Popen[bytes]], out: Path, timeout_s: float) -> None:
    """Until every rank exits 0; a failed rank or the deadline raises `BaselineError`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            r = failed[0]
            tail = (out / f"rank{r}.log").read_text(errors="replace")[-2000:]
            raise BaselineError(f"ddp rank {r} exited with {codes[r]}:\n{tail}")
        if all(c == 0 for c in codes):
            return
        time.sleep(0.2)
    raise BaselineError(f"ddp: not finished after {timeout_s:.0f} s; see {out}/rank*.log")


if __name__ == "__main__":
    worker(_parser().parse_args())
    exit_past_gloo_teardown()  # a failed rank raised above and exits non-zero

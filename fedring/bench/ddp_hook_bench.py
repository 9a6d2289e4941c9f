"""Local gloo ranks train digits with DDP: plain, torch's PowerSGD hook, or fedring's hook.

What it is for: `bench/ddp_hook.py` runs the three methods side by side and
`tests/engine/test_ddp_hook.py` runs ours; both through `run_world`, which spawns
`RunConfig.world` processes on 127.0.0.1, waits for them with a deadline and
kills them by PID if they overrun.

Every method trains the same task: fedring's iid digits shard of the rank,
fedring's seeded MLP (64-128-64-10, 17,226 parameters, one DDP bucket) and batch
order, `torch.optim.SGD` at a constant learning rate (plain SGD by default: see
the tuning guide in `fedring.engine.ddp_hook` on momentum). Only the gradient
averaging differs.

Bytes sent by a rank follow the ring convention: an all-reduce of B bytes sends
``2 (N - 1) / N x B`` and an all-gather of a P-byte payload ``(N - 1) x P``. Plain
DDP (no hook registered) counts the fp32 gradient each step; PowerSGD counts its
three all-reduces (uncompressed tensors, P, Q) from its own element counters, and
the whole bucket during its dense warm-up; group-top-k counts the bytes it packed.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket and Future[Tensor] types.

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from fedring.bench.launch import exit_past_gloo_teardown
from fedring.bench.powersgd import CountedPowerSGD, register_powersgd
from fedring.bench.sessions import free_port
from fedring.engine.ddp_hook import GroupTopKState, group_topk_hook, ring_allreduce_bytes
from fedring.engine.sampler import ShardSampler
from fedring.engine.task import evaluate_batches
from fedring.training.datasets import load_dataset
from fedring.training.models import build_model
from fedring.training.sharding import make_shards, shard_data

METHODS = ("ddp", "powersgd", "group-topk")


@dataclass(frozen=True)
class RunConfig:
    method: str = "group-topk"  # one of METHODS
    world: int = 4  # ranks, all on this host
    steps: int = 300  # optimizer steps, the same on every rank
    batch_size: int = 32  # per rank
    lr: float = 0.5  # SGD, constant
    momentum: float = 0.0  # see the tuning guide of fedring.engine.ddp_hook
    seed: int = 0  # model init, shards, batch order
    density: float = 0.01  # group-top-k: kept fraction of every group of 256
    start_compress_iter: int = 10  # dense all-reduce steps before either method compresses
    powersgd_rank: int = 1  # PowerSGD matrix_approximation_rank

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {', '.join(METHODS)}")
        if self.world < 1 or self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"world, steps and batch_size must be >= 1: {self}")


class _Meter(Protocol):
    """What the training loop reads from each method's state."""

    @property
    def sent_bytes(self) -> int: ...

    def step(self) -> None: ...

    def residual_norm(self) -> float: ...


class _AnalyticAllReduce:
    """Plain DDP: no hook, so the bytes are the ring all-reduce of every step."""

    def __init__(self, nbytes: int, world: int) -> None:
        self.per_step = ring_allreduce_bytes(nbytes, world)
        self.sent_bytes = 0

    def step(self) -> None:
        self.sent_bytes += self.per_step

    def residual_norm(self) -> float:
        return 0.0


class _TopKMeter:
    def __init__(self, state: GroupTopKState) -> None:
        self.state = state

    @property
    def sent_bytes(self) -> int:
        return self.state.sent_bytes

    def step(self) -> None:
        pass

    def residual_norm(self) -> float:
        return self.state.residual_norm()


def _plain(ddp: DistributedDataParallel, cfg: RunConfig) -> _AnalyticAllReduce:
    return _AnalyticAllReduce(sum(p.numel() for p in ddp.parameters()) * 4, cfg.world)


def _powersgd(ddp: DistributedDataParallel, cfg: RunConfig) -> CountedPowerSGD:
    return register_powersgd(ddp, cfg.world, rank=cfg.powersgd_rank,
                             start_iter=cfg.start_compress_iter, seed=cfg.seed)  # fmt: skip


def _group_topk(ddp: DistributedDataParallel, cfg: RunConfig) -> _TopKMeter:
    state = GroupTopKState(density=cfg.density, start_compress_iter=cfg.start_compress_iter)
    ddp.register_comm_hook(state, group_topk_hook)
    return _TopKMeter(state)


_SETUP: dict[str, Callable[[DistributedDataParallel, RunConfig], _Meter]] = {
    "ddp": _plain,
    "powersgd": _powersgd,
    "group-topk": _group_topk,
}


@dataclass(frozen=True, eq=False)
class _Shard:
    """One rank's data, made in the parent so that no rank imports scikit-learn."""

    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    feature_shape: tuple[int, ...]
    num_classes: int


def _shards(cfg: RunConfig) -> list[_Shard]:
    ds = load_dataset("digits", cfg.seed)
    parts = make_shards(ds.y_train.numpy(), cfg.world, "iid", cfg.seed)
    return [_Shard(*shard_data(ds, part), ds.x_test, ds.y_test, ds.feature_shape,
                   ds.num_classes) for part in parts]  # fmt: skip


def _train(rank: int, cfg: RunConfig, data: _Shard) -> dict[str, Any]:
    model = build_model("mlp", data.feature_shape, data.num_classes, cfg.seed)
    sampler = ShardSampler(len(data.x), batch_size=cfg.batch_size, seed=cfg.seed, rank=rank)
    ddp = DistributedDataParallel(model)
    meter = _SETUP[cfg.method](ddp, cfg)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(cfg.steps):
        idx = torch.tensor(sampler.next_batch())
        xb, yb = data.x[idx], data.y[idx]
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(ddp(xb), yb).backward()  # the hook runs in here
        opt.step()
        meter.step()
    dist.barrier()
    wall = time.perf_counter() - start
    _, accuracy = evaluate_batches(model, data.x_test, data.y_test, F.cross_entropy,
                                   lambda out, y: float((out.argmax(1) == y).sum()))  # fmt: skip
    return {"rank": rank, "accuracy": accuracy, "sent_bytes": meter.sent_bytes,
            "residual_norm": meter.residual_norm(), "wall_s": wall,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}  # fmt: skip


def _worker(rank: int, cfg: RunConfig, shards: list[_Shard], port: int, out: str) -> None:
    torch.set_num_threads(1)  # several ranks share a few cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are on this host
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cfg.world, timeout=timedelta(seconds=60))  # fmt: skip
    try:
        torch.save(_train(rank, cfg, shards[rank]), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    exit_past_gloo_teardown()  # a rank that raised goes back to spawn's error report


def run_world(cfg: RunConfig, out: Path, timeout_s: float = 180.0) -> list[dict[str, Any]]:
    """Train `cfg` on `cfg.world` spawned ranks; one result dict per rank, rank order.

    Raises
    ------
    TimeoutError
        The ranks did not all finish within `timeout_s` (they are killed first).
    torch.multiprocessing.ProcessRaisedException
        A rank raised; the others are stopped.
    """
    out.mkdir(parents=True, exist_ok=True)
    args = (cfg, _shards(cfg), free_port(), str(out))
    ctx = mp.start_processes(_worker, args=args, nprocs=cfg.world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{cfg.method}: ranks still running after {timeout_s} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()  # by PID: only the ranks this call started
                proc.join(5.0)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(cfg.world)]

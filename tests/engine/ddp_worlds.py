"""Spawned gloo worlds for the DDP hook's drop-in tests: one spawn per world size runs
every scenario on every rank and saves one result dict per scenario and rank.

A scenario that raises records ``{"error": repr(exc)}`` instead of sinking the world,
so each test reports its own failure. Every scenario raises (if it does) at the same
point on every rank, before a collective, so the ranks stay in step.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations against real types.

import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fedring.bench.launch import exit_past_gloo_teardown
from fedring.bench.sessions import free_port
from fedring.compression.group_topk import GroupTopK
from fedring.engine.ddp_hook import GroupTopKState, group_topk_hook

# FEDRING_TEST_DEVICE=cuda runs every scenario on cuda:0 (gloo with CUDA tensors):
# what CI cannot check, on a machine with a GPU.
DEVICE = torch.device(os.environ.get("FEDRING_TEST_DEVICE", "cpu"))
INJECT_STEP = 5  # a compressed step (start_compress_iter=2)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}  # fmt: skip


def _mlp(seed: int, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(DEVICE, dtype)


def _batch(gen: torch.Generator, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 16, generator=gen)
    teacher = torch.linspace(-1, 1, 64).reshape(16, 4)  # the same on every rank
    return x.to(DEVICE), torch.tanh(x @ teacher).to(DEVICE)


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]).cpu()


def nonfinite(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 turns one gradient entry into inf at `INJECT_STEP`; GradScaler-style
    training skips any step whose gradients are not all finite."""
    model = _mlp(0)
    ddp = DistributedDataParallel(model)
    state = GroupTopKState(density=0.05, start_compress_iter=2)
    ddp.register_comm_hook(state, group_topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    first = next(model.parameters())  # the first layer's weight

    def inject(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g[0, 0] = float("inf")
        return g

    finite, norms, corner, bad = [], [], [], []
    for step in range(12):
        handle = first.register_hook(inject) if step == INJECT_STEP and rank == 0 else None
        x, y = _batch(gen)
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        if handle is not None:
            handle.remove()
        ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all())
                 for p in model.parameters())  # fmt: skip
        finite.append(ok)
        assert first.grad is not None
        bad.append(torch.nonzero(~torch.isfinite(first.grad)).tolist())
        if ok:
            opt.step()
        norms.append(state.residual_norm())
        corner.append(float(first.detach()[0, 0]))
    return {"finite": finite, "residual_norms": norms, "corner": corner, "bad": bad,
            "params": _params(model)}  # fmt: skip


class _TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, c: torch.Tensor, use_b: bool) -> torch.Tensor:
        # linear in the parameters: the gradients do not depend on them, so both
        # runs see the same gradients and their applied sums compare directly
        out = (self.a(x) * c).sum()
        return out + (self.b(x) * c).sum() if use_b else out


USE_B = [True] * 4 + [False] * 6 + [True] * 3


def _applied_mass(rank: int, hooked: bool) -> dict[str, torch.Tensor]:
    model = _TwoBranch().to(DEVICE)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    state = GroupTopKState(density=0.1, group_size=32, start_compress_iter=2)
    if hooked:
        ddp.register_comm_hook(state, group_topk_hook)
    gen = torch.Generator().manual_seed(100 + rank)
    applied = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for step, use_b in enumerate([*USE_B, True]):
        if step == len(USE_B):  # the last step sends everything: residuals flushed
            state.compressor = GroupTopK(group_size=32, k=32)
        ddp.zero_grad(set_to_none=True)
        x, c = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
        x, c = x.to(DEVICE), c.to(DEVICE)
        ddp(x, c, use_b).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                applied[name] += p.grad
    return {name: mass.cpu() for name, mass in applied.items()}


def unused(rank: int, world: int) -> dict[str, Any]:
    """The gradient mass DDP applies to a parameter unused on every rank for six
    steps, with the hook (density 10%, flushed at the end) and without."""
    return {"hook": _applied_mass(rank, True), "ddp": _applied_mass(rank, False)}


def dtypes(rank: int, world: int) -> dict[str, Any]:
    """The same regression trained with the hook in every float dtype."""
    out: dict[str, Any] = {}
    for name, dtype in DTYPES.items():
        model = _mlp(2, dtype)
        ddp = DistributedDataParallel(model)
        state = GroupTopKState(density=0.05, start_compress_iter=5)
        ddp.register_comm_hook(state, group_topk_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        gen = torch.Generator().manual_seed(200 + rank)
        losses = []
        for _ in range(80):
            x, y = _batch(gen)
            opt.zero_grad()
            loss = F.mse_loss(ddp(x.to(dtype)), y.to(dtype))
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        out[name] = {"losses": losses, "params": _params(model),
                     "residual_norm": state.residual_norm()}  # fmt: skip
    return out


def pickled(rank: int, world: int) -> dict[str, Any]:
    """Train, pickle the state, go on with the unpickled copy on a fresh DDP model."""
    gen = torch.Generator().manual_seed(300 + rank)

    def train(model: nn.Module, state: GroupTopKState, steps: int) -> None:
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(state, group_topk_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            x, y = _batch(gen)
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()

    # an explicit group, as PowerSGD's users pass one: process groups do not pickle
    state = GroupTopKState(dist.group.WORLD, density=0.05, start_compress_iter=2)
    model = _mlp(3)
    train(model, state, 4)
    copy = pickle.loads(pickle.dumps(state))
    same = {i: bool(torch.equal(ef.residual, copy.error_feedback[i].residual))
            for i, ef in state.error_feedback.items()}  # fmt: skip
    resumed = _mlp(3)
    resumed.load_state_dict(model.state_dict())
    train(resumed, copy, 4)
    return {"same_residuals": same, "iter": (state.iter, copy.iter),
            "params": _params(resumed), "copy_group": copy.process_group}  # fmt: skip


def shared(rank: int, world: int) -> dict[str, Any]:
    """One state registered on two DDP models of the same shape."""
    state = GroupTopKState(density=0.05, start_compress_iter=2)
    first, second = DistributedDataParallel(_mlp(4)), DistributedDataParallel(_mlp(4))
    first.register_comm_hook(state, group_topk_hook)
    second.register_comm_hook(state, group_topk_hook)
    gen = torch.Generator().manual_seed(400 + rank)
    x, y = _batch(gen)
    F.mse_loss(first(x), y).backward()
    try:
        F.mse_loss(second(x), y).backward()
    except Exception as exc:  # the refusal comes back through DDP's reducer
        return {"refused": repr(exc)}
    return {"refused": None}


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "nonfinite": nonfinite, "unused": unused, "dtypes": dtypes, "pickled": pickled,
    "shared": shared,
}  # fmt: skip


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)  # several ranks share a few cores
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    try:
        results: dict[str, Any] = {}
        for name, scenario in SCENARIOS.items():
            try:
                results[name] = scenario(rank, world)
            except Exception as exc:
                results[name] = {"error": repr(exc)}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    exit_past_gloo_teardown()


def run_scenarios(world: int, out: Path, timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """Every scenario on `world` spawned gloo ranks; one dict of results per rank."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_worker, args=(world, free_port(), str(out)), nprocs=world,
                             join=False, start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"ranks still running after {timeout_s} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()  # by PID: only the ranks this call started
                proc.join(5.0)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]

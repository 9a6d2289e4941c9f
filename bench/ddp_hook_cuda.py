"""fedring's DDP hook on a GPU: parity with plain DDP at density 1.0 and a short training run.

Two ranks share one device (both on cuda:0, or both on the CPU with --device cpu).
NCCL refuses two ranks on one GPU, so the script first tries a two-rank NCCL world
and falls back to gloo with CUDA tensors (which DDP supports); after a fallback it
also runs the parity check on a one-rank NCCL world, so that the hook's NCCL path
(all-gather on the device) runs too. It prints which backend ran each part.

For fp32 and bf16 models (a 3-layer MLP on a seeded synthetic teacher task, plain
SGD, `bucket_cap_mb=2` so that there are several buckets), it measures:

- parity: the largest absolute difference between the parameters of plain DDP and of
  DDP with the hook at density 1.0 (fp32 values) after `--parity-steps` steps (dense
  warm-up 2);
- training: `--steps` steps at `--density` (groups of 256, values in the model's
  dtype, dense warm-up 10) against
  plain DDP from the same start on the same batches: final loss of each (mean of
  the last 10 steps, rank 0's batches) and the bytes ratio: what plain all-reduce
  sends (ring convention, ``2 (N-1)/N x bucket`` a step) over what the hook sent.

Needs only torch (with CUDA for the default device) and numpy; fedring is imported
from this checkout. The last line printed is everything as one JSON object.

    python bench/ddp_hook_cuda.py [--device cuda|cpu] [--steps 200] [--parity-steps 20]
                                  [--density 0.01] [--hidden 1024]
"""

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    import fedring  # noqa: F401
except ImportError:  # a bare checkout: import fedring from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedring.compression.values import ValueDtype
from fedring.engine.ddp_hook import GroupTopKState, group_topk_hook

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VALUES: dict[str, ValueDtype] = {"fp32": "fp32", "bf16": "bf16"}  # kept values travel so
FEATURES, CLASSES, BATCH = 256, 10, 64


def _model(cfg: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    h = cfg.hidden
    net = nn.Sequential(nn.Linear(FEATURES, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                        nn.Linear(h, CLASSES))  # fmt: skip
    return net.to(device=device, dtype=dtype)


def _batches(rank: int, steps: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """The same batches for every method: a fixed random teacher labels Gaussian inputs."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(99))
    gen = torch.Generator().manual_seed(1000 + rank)
    out: list[tuple[torch.Tensor, ...]] = []
    for _ in range(steps):
        x = torch.randn(BATCH, FEATURES, generator=gen)
        out.append((x.to(device), (x @ teacher).argmax(1).to(device)))
    return out


def _train(cfg: argparse.Namespace, rank: int, dtype: torch.dtype, steps: int,
           state: GroupTopKState | None) -> tuple[nn.Module, list[float], float]:  # fmt: skip
    device = torch.device(cfg.device)
    model = _model(cfg, dtype, device)
    ddp = DistributedDataParallel(model, bucket_cap_mb=2)
    if state is not None:
        ddp.register_comm_hook(state, group_topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    start = time.perf_counter()
    for x, y in _batches(rank, steps, device):
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x.to(dtype)).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return model, [float(v) for v in losses], time.perf_counter() - start


def _parity(cfg: argparse.Namespace, rank: int, dtype: torch.dtype) -> float:
    plain, _, _ = _train(cfg, rank, dtype, cfg.parity_steps, None)
    hooked, _, _ = _train(cfg, rank, dtype, cfg.parity_steps,
                          GroupTopKState(density=1.0, value_dtype="fp32",
                                         start_compress_iter=2))  # fmt: skip
    return max(float((a.detach().double() - b.detach().double()).abs().max())
               for a, b in zip(plain.parameters(), hooked.parameters(), strict=True))  # fmt: skip


def _training(cfg: argparse.Namespace, rank: int, name: str) -> dict[str, Any]:
    dtype = DTYPES[name]
    _, plain, plain_s = _train(cfg, rank, dtype, cfg.steps, None)
    state = GroupTopKState(density=cfg.density, value_dtype=VALUES[name], start_compress_iter=10)
    _, hooked, hooked_s = _train(cfg, rank, dtype, cfg.steps, state)
    return {"ddp_final_loss": sum(plain[-10:]) / 10, "hook_final_loss": sum(hooked[-10:]) / 10,
            "first_loss": plain[0], "bytes_ratio": state.dense_equivalent_bytes / state.sent_bytes,
            "ddp_s": plain_s, "hook_s": hooked_s, "residual_norm": state.residual_norm(),
            "nonfinite_buckets": state.nonfinite_buckets}  # fmt: skip


def _worker(rank: int, cfg: argparse.Namespace, world: int, backend: str, task: str,
            out: str) -> None:  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (2 * world)))
    if cfg.device == "cuda":
        torch.cuda.set_device(0)
    # A file store, not a TCP port: a port probed free and then bound by the ranks can be
    # taken in between by another process (two test workers side by side).
    dist.init_process_group(backend, init_method=f"file://{out}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    try:
        if task == "probe":  # one collective of each kind the hook uses
            t = torch.ones(4, device=cfg.device)
            dist.all_reduce(t)
            dist.all_gather([torch.empty_like(t) for _ in range(world)], t)
            result: dict[str, Any] = {"ok": True}
        else:
            result = {f"parity_max_abs_diff_{n}": _parity(cfg, rank, d) for n, d in DTYPES.items()}
            if task == "all":
                result.update({f"train_{n}": _training(cfg, rank, n) for n in DTYPES})
        if rank == 0:
            Path(out, "result.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Its result written and its group destroyed, a rank ends without the interpreter's
    # teardown: torch 2.13's gloo teardown sometimes aborts there under load (as
    # `fedring.bench.launch.exit_past_gloo_teardown` says), which spawn reports as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _world(cfg: argparse.Namespace, world: int, backend: str, task: str,
           timeout_s: float) -> dict[str, Any] | str:  # fmt: skip
    """Run `task` on `world` spawned ranks; the result, or why there is none."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_worker, args=(cfg, world, backend, task, out),
                                 nprocs=world, join=False, start_method="spawn")  # fmt: skip
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    return f"timed out after {timeout_s:.0f} s"
        except Exception as exc:  # a rank raised: spawn reports its traceback
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()  # by PID: only the ranks this call started
                    proc.join(5.0)
        path = Path(out, "result.json")
        return json.loads(path.read_text()) if path.exists() else "no result written"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--parity-steps", type=int, default=20)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.1)
    cfg = p.parse_args()
    if cfg.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu")
    report: dict[str, Any] = {"device": cfg.device, "torch": torch.__version__, "world": 2,
                              "steps": cfg.steps, "density": cfg.density}  # fmt: skip
    report["card"] = torch.cuda.get_device_name(0) if cfg.device == "cuda" else "cpu"
    print(f"card: {report['card']}, torch {torch.__version__}", flush=True)
    backend = "gloo"
    if cfg.device == "cuda":
        probe = _world(cfg, 2, "nccl", "probe", 90.0)
        report["nccl_world2"] = "ok" if isinstance(probe, dict) else probe
        print(f"nccl, 2 ranks on one GPU: {report['nccl_world2']}", flush=True)
        backend = "nccl" if isinstance(probe, dict) else "gloo"
    report["backend"] = backend
    print(f"world 2 over {backend} ({cfg.device} tensors)", flush=True)
    start = time.perf_counter()
    result = _world(cfg, 2, backend, "all", 600.0)
    report["world2"] = result
    print(json.dumps(result, indent=1), flush=True)
    if cfg.device == "cuda" and backend != "nccl":
        report["nccl_world1_parity"] = _world(cfg, 1, "nccl", "parity", 120.0)
        print(f"nccl world 1 parity: {report['nccl_world1_parity']}", flush=True)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

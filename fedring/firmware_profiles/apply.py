"""Apply a profile on an agent: threads, batch size, dtype, frame size, deadlines, memory.

`AgentSettings` is what the agent takes from its profile (flags may override the
thread count) and announces in its hello. `estimate_memory` counts what one job
would hold on the board and `check_budget` refuses a job that would not fit
*before* anything is trained, with the estimate and the budget in the message
(`fedring simulate --fleet rpi-zero-2w:4 --dataset synthetic:500:20000:10`)::

    job needs ~498.3 MB on rpi-zero-2w but its budget is 115 MB (compute.ram_budget_mb)
    + 220 MB for the runtime: 2,569,034 parameters x 24 fp32 copies = 235.2 MB,
    activations 5.0 MB (batch 32), data 38.2 MB, runtime 220.0 MB (assumed)

The runtime counts too: the agent process's resident memory when it checks the job
(the interpreter, torch, fedring, the dataset's packages and the loaded dataset),
measured by the agent (`runtime_rss`);
where nothing is measured (the simulator's `--fleet`), the 220 MB that every
profile's budget comment sets aside for it. A board whose runtime is heavier than
that has less left for the job (docs/fleet.md has the measured figures).

The copies counted per parameter (fp32) are those the code keeps: the weights,
their ``.grad``, the flat gradient, the optimizer velocity, the reduced vector and
the ring's accumulator; with group-top-k also the residual, the compensated
gradient and its decompressed copy; one rollback snapshot (weights, velocity,
residual); and the agent's retry states (`RETRY_STATES` x the same three).
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedring.config import JobSpec
from fedring.firmware_profiles.schema import Profile

RETRY_STATES = 4  # edge_agent.worker.KEEP_SNAPSHOTS (a test keeps them equal)
MB = 1 << 20
# The torch runtime every profile's ram_budget_mb leaves out (see their comments):
# a process may hold the budget plus this much; a measured runtime replaces it.
RUNTIME_MB = 220


class OverBudget(ValueError):
    """A job whose estimated memory exceeds the board's budget."""


@dataclass(frozen=True)
class AgentSettings:
    profile: str
    link: str
    torch_threads: int
    batch_size: int  # the board's default; a job's own batch size wins in a ring
    dtype: str
    max_frame_bytes: int
    keepalive_s: int
    round_deadline_s: float
    onnx_providers: tuple[str, ...]
    ram_budget_mb: int
    gflops: float

    def hello(self) -> dict[str, Any]:
        """What the agent announces (the coordinator orders the ring and sizes deadlines)."""
        doc = asdict(self)
        doc["onnx_providers"] = list(self.onnx_providers)
        return doc


def settings_for(
    profile: Profile, link: str | None = None, threads: int | None = None
) -> AgentSettings:
    return AgentSettings(
        profile=profile.name, link=profile.link(link).name,
        torch_threads=threads or profile.torch_threads, batch_size=profile.batch_size,
        dtype=profile.dtype, max_frame_bytes=profile.max_frame_bytes,
        keepalive_s=profile.keepalive_s, round_deadline_s=profile.round_deadline_s,
        onnx_providers=profile.onnx_providers, ram_budget_mb=profile.ram_budget_mb,
        gflops=profile.gflops,
    )  # fmt: skip


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    copies: int
    activations_bytes: int
    data_bytes: int
    batch_size: int
    runtime_bytes: int = 0  # the process before the job, measured; 0: RUNTIME_MB assumed

    @property
    def params_bytes(self) -> int:
        return self.params * 4 * self.copies

    @property
    def runtime(self) -> int:
        return self.runtime_bytes or RUNTIME_MB * MB

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.activations_bytes + self.data_bytes + self.runtime

    def describe(self) -> str:
        how = "measured" if self.runtime_bytes else "assumed"
        return (
            f"{self.params:,} parameters x {self.copies} fp32 copies = "
            f"{self.params_bytes / MB:.1f} MB, activations {self.activations_bytes / MB:.1f} MB "
            f"(batch {self.batch_size}), data {self.data_bytes / MB:.1f} MB, "
            f"runtime {self.runtime / MB:.1f} MB ({how})"
        )


def runtime_rss() -> int:
    """This process's resident bytes now (Linux ``/proc/self/statm``; 0 elsewhere).
    An agent calls it when it checks a job, its dataset loaded, before training."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def copies_per_param(spec: JobSpec) -> int:
    compressed = spec.compression == "group-topk" or spec.aggregation == "vote"
    state = 3 if compressed else 2  # weights, velocity (, residual)
    working = 6 + (3 if compressed else 0)
    return working + state * (1 + RETRY_STATES)


def activation_bytes(model: nn.Module, feature_shape: tuple[int, ...], batch: int) -> int:
    """Outputs of every leaf module for one batch, kept for backward, plus their gradients."""
    total = 0

    def hook(_m: nn.Module, _i: Any, out: Any) -> None:
        nonlocal total
        if isinstance(out, torch.Tensor):
            total += out.numel()

    twin = copy.deepcopy(model).eval()  # the job's model keeps its state (BatchNorm stats)
    leaves = [m for m in twin.modules() if not list(m.children())]
    for m in leaves:
        m.register_forward_hook(hook)
    with torch.no_grad():
        twin(torch.zeros((1, *feature_shape)))
    return total * batch * 4 * 2


def estimate_memory(
    spec: JobSpec, model: nn.Module, feature_shape: tuple[int, ...], data_bytes: int,
    runtime_bytes: int = 0,
) -> MemoryEstimate:  # fmt: skip
    """What the job would hold, plus the runtime (`runtime_rss` at start-up; 0: assumed)."""
    return MemoryEstimate(
        params=sum(p.numel() for p in model.parameters()),
        copies=copies_per_param(spec),
        activations_bytes=activation_bytes(model, feature_shape, spec.batch_size),
        data_bytes=data_bytes,
        batch_size=spec.batch_size,
        runtime_bytes=runtime_bytes,
    )


def job_memory(spec: JobSpec) -> MemoryEstimate:
    """Load the job's dataset and model as an agent would, and estimate the memory."""
    from fedring.build import task_of

    task = task_of(spec)
    ds = task.dataset(spec.seed)
    model = task.model(ds, spec.seed)
    return estimate_memory(spec, model, ds.feature_shape, dataset_bytes(ds))


def dataset_bytes(ds: Any) -> int:
    """An agent loads the whole dataset, then keeps its shard (see edge_agent.worker)."""
    return sum(t.numel() * t.element_size() for t in (ds.x_train, ds.y_train, ds.x_test, ds.y_test))


def check_budget(profile: Profile, estimate: MemoryEstimate) -> None:
    """Refuse (OverBudget) a job whose estimate, runtime included, exceeds the
    profile's RAM budget plus the `RUNTIME_MB` it leaves out for the runtime."""
    need = estimate.total_bytes / MB
    if need > profile.ram_budget_mb + RUNTIME_MB:
        raise OverBudget(
            f"job needs ~{need:.1f} MB on {profile.name} but its budget is "
            f"{profile.ram_budget_mb} MB (compute.ram_budget_mb) + {RUNTIME_MB} MB for the "
            f"runtime: {estimate.describe()}"
        )


def resolve(choice: str) -> tuple[Profile, str | None, str]:
    """``auto`` (detect this board), ``NAME[/wifi|/ethernet]``, or a profile file
    ``PATH.toml[/LINK]`` checked like `fedring profile check`: (profile, link, why)."""
    from fedring.firmware_profiles.detect import detect
    from fedring.firmware_profiles.schema import ProfileError, load_builtin, load_profile

    if choice == "auto":
        found = detect()
        return found.profile, None, found.reason
    if ".toml" in choice:
        path, _, link = choice.partition(".toml")
        profile = load_profile(Path(path + ".toml"))
        link = link.removeprefix("/")
        if link:
            profile.link(link)
        return profile, link or None, f"--profile {choice}"
    name, _, link = choice.partition("/")
    profile = load_builtin(name)
    if link:
        profile.link(link)  # ProfileError when the board has no such link
    elif "/" in choice:
        raise ProfileError(f"--profile {choice!r}: expected NAME or NAME/wifi or NAME/ethernet")
    return profile, link or None, f"--profile {choice}"

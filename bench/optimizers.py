"""Which `torch.optim` optimizer to wrap: SGD, SGD with momentum and AdamW, dense and compressed.

One run, two built-in tasks (digits with the MLP, MNIST-1D with the paper's CNN),
4 agents in-process, iid shards, sync mode, a fixed number of rounds. Each
optimizer is wrapped by `DistributedOptimizer` over a dense fp32 ring and over
group-top-k 1% + error feedback (the `ReducerSettings` defaults: G = 256, k = 3,
fp16 values, bounded ring, no density warm-up). A DGC row moves the momentum into
error feedback instead (`momentum_correction=0.9`, SGD momentum 0).

Every run starts from the same planned parameters and shards
(`engine.plan.plan`/`prepare`) and trains through the engine's loop
(`engine.loop.run`); rates follow `LinearScaling` (batch 32 per agent, reference
batch 32, 50 warm-up steps): linear x4 for SGD, sqrt x2 for AdamW (the module's
advice for Adam). The loop's divergence monitor rolls back and halves the rate
when the held-out loss blows up (checked every `EVAL_EVERY` rounds); the table
counts those rollbacks.

Bytes are wire bytes sent per agent, frame headers included
(`groups[r].channel.endpoint.stats.bytes_sent`, mean over agents); the ratio is
dense bytes / compressed bytes for the same optimizer and rounds.

    python bench/optimizers.py [--digits-rounds 300] [--mnist1d-rounds 600] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fedring.engine.group import Group, local_group
from fedring.engine.loop import LoopResult, LoopSettings, Member, run
from fedring.engine.lr import LinearScaling
from fedring.engine.optimizer import DistributedOptimizer, SyncSettings
from fedring.engine.plan import Plan, plan, prepare
from fedring.engine.reducer import Reducer, ReducerSettings
from fedring.engine.sampler import ShardSampler
from fedring.engine.state import TrainerState
from fedring.engine.task import ClassificationTask
from fedring.training.models import params_sha256
from fedring.transport.inproc import InprocTransport

AGENTS = 4
BATCH = 32  # per agent, also the reference batch of every base rate
WARMUP = 50  # steps of gradual warm-up to the scaled rate
EVAL_EVERY = 50  # rounds between held-out checks (divergence monitor)
Make = Callable[[Iterable[torch.nn.Parameter], float], torch.optim.Optimizer]


@dataclass(frozen=True)
class Recipe:
    """One wrapped optimizer: how to build it, its base rate and its scaling."""

    name: str
    make: Make
    lr: float  # for one agent at batch 32
    scaling: str  # LinearScaling: linear (x N) or sqrt (x sqrt N)
    momentum_correction: float = 0.0  # DGC: momentum inside error feedback
    dense: bool = True  # also run over the dense ring

    @property
    def peak_lr(self) -> float:
        return self.lr * (AGENTS if self.scaling == "linear" else AGENTS**0.5)


def _sgd(momentum: float) -> Make:
    return lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=momentum)


def _adamw(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


# Base rates: fedring's defaults for SGD (0.1 plain EF-SGD, 0.025 with momentum);
# AdamW 3e-3, the best of 1e-3 and 3e-3 on both tasks, dense and compressed.
RECIPES = (
    Recipe("SGD", _sgd(0.0), 0.1, "linear"),
    Recipe("SGD momentum 0.9", _sgd(0.9), 0.025, "linear"),
    Recipe("AdamW", _adamw, 3e-3, "sqrt"),
    Recipe(
        "SGD, DGC momentum 0.9 in EF",
        _sgd(0.0),
        0.025,
        "linear",
        momentum_correction=0.9,
        dense=False,
    ),
)
TASKS = {"digits": ClassificationTask("digits", "mlp"),
         "mnist1d": ClassificationTask("mnist1d", "cnn")}  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    accuracy: float
    bytes_per_agent: float
    rollbacks: int
    identical: bool


def member(p: Plan, rank: int, group: Group, recipe: Recipe, compressed: bool, seed: int) -> Member:
    """One agent: its verified shard, the planned start, `recipe`'s optimizer wrapped."""
    model, x, y = prepare(p.task, p.dataset, p.manifest, p.shards[rank], rank, seed=seed,
                          model_sha256=p.model_sha256, initial=p.initial)  # fmt: skip
    inner = recipe.make(model.parameters(), recipe.lr)
    settings = ReducerSettings(compression="group-topk" if compressed else "none",
                               momentum_correction=recipe.momentum_correction)  # fmt: skip
    reducer = Reducer(group.collective, sum(q.numel() for q in model.parameters()), settings)
    opt = DistributedOptimizer(inner, reducer, SyncSettings(mode="sync"), model=model,
                               weight=p.weights[rank])  # fmt: skip
    scaling = LinearScaling(inner, world=AGENTS, batch_size=BATCH, ref_batch=BATCH,
                            warmup_steps=WARMUP, scaling=recipe.scaling)  # fmt: skip
    sampler = ShardSampler(len(x), batch_size=BATCH, seed=seed, rank=rank)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(sampler.next_batch())
        return x[idx], y[idx]

    return Member(TrainerState(model, opt, sampler), next_batch, p.task.loss,
                  lambda m: p.task.evaluate(m, p.dataset), scaling)  # fmt: skip


def train(p: Plan, recipe: Recipe, compressed: bool, rounds: int, seed: int) -> Outcome:
    """`AGENTS` agents on threads, taking turns on the in-process hub as the simulator does."""
    hub = InprocTransport(cooperative=True)
    groups = local_group(AGENTS, job="bench-optimizers", hub=hub)
    members = [member(p, r, groups[r], recipe, compressed, seed) for r in range(AGENTS)]
    loop = LoopSettings(rounds=rounds, eval_every=EVAL_EVERY)

    def agent(rank: int) -> LoopResult:
        try:
            with hub.baton.turn() if hub.baton else contextlib.nullcontext():
                return run(members[rank], loop)
        except BaseException:
            groups[rank].channel.endpoint.close()  # neighbours fail fast
            raise
        finally:
            members[rank].state.optimizer.close()

    with ThreadPoolExecutor(max_workers=AGENTS) as pool:
        results = [f.result() for f in [pool.submit(agent, r) for r in range(AGENTS)]]
    sent = [g.channel.endpoint.stats.bytes_sent for g in groups]
    hashes = {params_sha256(m.state.model) for m in members}
    return Outcome(results[0].evals[-1]["accuracy"], sum(sent) / AGENTS,
                   results[0].rollbacks, len(hashes) == 1)  # fmt: skip


def _cell(o: Outcome | None) -> tuple[str, str]:
    if o is None:
        return "—", "—"
    flags = f" ({o.rollbacks} rollbacks)" if o.rollbacks else ""
    if not o.identical:
        flags += " (agents DIFFER)"
    return f"{o.accuracy:.3f}{flags}", f"{o.bytes_per_agent / 1e6:.2f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits-rounds", type=int, default=300)
    parser.add_argument("--mnist1d-rounds", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # four agent threads on a small machine
    rounds = {"digits": args.digits_rounds, "mnist1d": args.mnist1d_rounds}
    start = time.perf_counter()
    print("| task | optimizer (base lr → peak) | dense acc | dense bytes/agent "
          "| top-k 1% + EF acc | top-k bytes/agent | dense / top-k bytes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, task in TASKS.items():
        p = plan(task, agents=AGENTS, seed=args.seed)
        for recipe in RECIPES:
            dense = train(p, recipe, False, rounds[name], args.seed) if recipe.dense else None
            sparse = train(p, recipe, True, rounds[name], args.seed)
            ratio = f"{dense.bytes_per_agent / sparse.bytes_per_agent:.1f}x" if dense else "—"
            print(f"| {name} | {recipe.name} ({recipe.lr:g} → {recipe.peak_lr:g}) | "
                  f"{' | '.join(_cell(dense))} | {' | '.join(_cell(sparse))} | {ratio} |",
                  flush=True)  # fmt: skip
    wall = time.perf_counter() - start
    print(f"\n{AGENTS} agents in-process, iid shards, sync mode, seed {args.seed}; rounds: "
          f"digits {rounds['digits']} (MLP), mnist1d {rounds['mnist1d']} (CNN); batch {BATCH} "
          f"per agent; base lr for one agent at batch {BATCH}, scaled x{AGENTS} (SGD, linear) or "
          f"x{AGENTS**0.5:g} (AdamW, sqrt) over {WARMUP} warm-up steps. top-k: group-top-k "
          "G=256 k=3, fp16 values, error feedback. Accuracy: held-out, after the last round "
          "(all agents identical unless marked). Bytes: wire bytes sent per agent incl. frame "
          f"headers (endpoint.stats.bytes_sent). Wall {wall:.0f} s.")  # fmt: skip


if __name__ == "__main__":
    main()

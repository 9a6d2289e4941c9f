"""Which `torch.optim` optimizer to wrap, and what the group agrees on: SGD, SGD with
momentum and AdamW, dense and compressed, agreeing on the gradient or the update.

One run, two built-in tasks (digits with the MLP, MNIST-1D with the paper's CNN),
4 agents in-process, iid shards, a fixed number of rounds. Each optimizer is
wrapped by `DistributedOptimizer` over a dense fp32 ring and over group-top-k 1% +
error feedback (the `ReducerSettings` defaults: G = 256, k = 3, fp16 values,
bounded ring, no density warm-up), once per `SyncSettings.agree`:

- dense: the gradient (what ``auto`` picks over a dense ring);
- dense, agree=update: the update's dense twin (each member's own optimizer state,
  no compression), for the optimizers ``auto`` gives the update;
- top-k, agree=gradient: the agreed sparse gradient into the wrapped optimizer;
- top-k, agree=update: each member's optimizer steps on its own gradient (taken at
  its view) and the group agrees on the step's parameter delta (what ``auto``
  picks for all but plain SGD).

A DGC row moves the momentum into error feedback instead (`momentum_correction=0.9`,
SGD momentum 0, on the gradient). ``--local-steps H`` runs local mode instead (H
steps a round, rounds / H, as many steps): its top-k columns are ``auto`` (local
mode as it was) and ``update`` (each member's steps start from its view).

Every run starts from the same planned parameters and shards
(`engine.plan.plan`/`prepare`) and trains through the engine's loop
(`engine.loop.run`); rates follow `LinearScaling` (batch 32 per agent, reference
batch 32, 50 warm-up steps): linear x4 for SGD, sqrt x2 for AdamW (the module's
advice for Adam). AdamW runs at base 3e-3 and 6e-3 (the better dense rate of
1e-3, 3e-3, 6e-3 on MNIST-1D, and the linear x4 of 3e-3: under the update a
member's Adam normalises by its own batch's moments and steps shorter). The loop's
divergence monitor rolls back and halves the rate when the held-out loss blows up
(checked every `EVAL_EVERY` rounds); the table counts those rollbacks.

Bytes are wire bytes sent per agent, frame headers included
(`groups[r].channel.endpoint.stats.bytes_sent`, mean over agents, seed 0); the
ratio is dense bytes / compressed (update) bytes for the same optimizer and rounds.

    python bench/optimizers.py [--seeds 0,1,2] [--tasks digits,mnist1d]
        [--digits-rounds 300] [--mnist1d-rounds 600] [--local-steps 0]

Measured (``--seeds 0,1,2``, mean of 3 seeds; 2-core machine, about 20 min): see
`engine.sync_settings` for the table's figures.
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
# AdamW 3e-3 (the best of 1e-3 and 3e-3 before the update agreement) and 6e-3.
RECIPES = (
    Recipe("SGD", _sgd(0.0), 0.1, "linear"),
    Recipe("SGD momentum 0.9", _sgd(0.9), 0.025, "linear"),
    Recipe("AdamW", _adamw, 3e-3, "sqrt"),
    Recipe("AdamW", _adamw, 6e-3, "sqrt"),
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


@dataclass(frozen=True)
class Way:
    """How the group agrees: over which ring, on what, in which mode."""

    compressed: bool
    agree: str = "gradient"  # SyncSettings.agree
    local_steps: int = 0  # 0: sync mode, else local mode with H = local_steps
    density: float | str = 0.01  # compressed: a fixed density, or "auto" for the rounds


def member(p: Plan, rank: int, group: Group, recipe: Recipe, way: Way, seed: int,
           rounds: int) -> Member:  # fmt: skip
    """One agent: its verified shard, the planned start, `recipe`'s optimizer wrapped."""
    model, x, y = prepare(p.task, p.dataset, p.manifest, p.shards[rank], rank, seed=seed,
                          model_sha256=p.model_sha256, initial=p.initial)  # fmt: skip
    inner = recipe.make(model.parameters(), recipe.lr)
    settings = ReducerSettings(compression="group-topk" if way.compressed else "none",
                               momentum_correction=recipe.momentum_correction,
                               density=way.density, rounds=rounds)  # fmt: skip
    reducer = Reducer(group.collective, sum(q.numel() for q in model.parameters()), settings)
    sync = (SyncSettings(mode="local", local_steps=way.local_steps, agree=way.agree)
            if way.local_steps else SyncSettings(mode="sync", agree=way.agree))  # fmt: skip
    opt = DistributedOptimizer(inner, reducer, sync, model=model, weight=p.weights[rank])
    scaling = LinearScaling(inner, world=AGENTS, batch_size=BATCH, ref_batch=BATCH,
                            warmup_steps=WARMUP, scaling=recipe.scaling)  # fmt: skip
    sampler = ShardSampler(len(x), batch_size=BATCH, seed=seed, rank=rank)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(sampler.next_batch())
        return x[idx], y[idx]

    return Member(TrainerState(model, opt, sampler), next_batch, p.task.loss,
                  lambda m: p.task.evaluate(m, p.dataset), scaling)  # fmt: skip


def train(p: Plan, recipe: Recipe, way: Way, rounds: int, seed: int) -> Outcome:
    """`AGENTS` agents on threads, taking turns on the in-process hub as the simulator does."""
    hub = InprocTransport(cooperative=True)
    groups = local_group(AGENTS, job="bench-optimizers", hub=hub)
    members = [member(p, r, groups[r], recipe, way, seed, rounds) for r in range(AGENTS)]
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


def _cell(runs: list[Outcome]) -> str:
    """Mean accuracy over seeds, each seed's in brackets, and anything unusual."""
    if not runs:
        return "—"
    mean = sum(o.accuracy for o in runs) / len(runs)
    cell = f"{mean:.3f}"
    if len(runs) > 1:
        cell += f" ({', '.join(f'{o.accuracy:.3f}' for o in runs)})"
    rollbacks = sum(o.rollbacks for o in runs)
    if rollbacks:
        cell += f" ({rollbacks} rollbacks)"
    if not all(o.identical for o in runs):
        cell += " (agents DIFFER)"
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits-rounds", type=int, default=300)
    parser.add_argument("--mnist1d-rounds", type=int, default=600)
    parser.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1,2")
    parser.add_argument("--tasks", default="digits,mnist1d")
    parser.add_argument("--local-steps", type=int, default=0,
                        help="H: local mode, rounds / H (as many steps); 0: sync")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)  # four agent threads on a small machine
    seeds = [int(s) for s in args.seeds.split(",")]
    h = args.local_steps
    rounds = {"digits": args.digits_rounds, "mnist1d": args.mnist1d_rounds}
    rounds = {k: v // max(1, h) for k, v in rounds.items()}
    topk_way = "agree=gradient" if not h else "agree=auto (as before)"
    start = time.perf_counter()
    print(f"| task | optimizer (base lr → peak) | dense | dense, agree=update "
          f"| top-k 1% + EF, {topk_way} | top-k 1% + EF, agree=update "
          "| dense / top-k bytes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in args.tasks.split(","):
        p = {seed: plan(TASKS[name], agents=AGENTS, seed=seed) for seed in seeds}
        for recipe in RECIPES:
            if h and not recipe.dense:
                continue  # DGC runs the gradient: sync mode only
            twin = not h and recipe.dense and recipe.name != "SGD"  # auto: the update
            ways = {
                "dense": Way(False, "auto", h) if recipe.dense else None,
                # the update's dense twin: each member's own moments, no compression
                "dense_update": Way(False, "update") if twin else None,
                "topk": Way(True, "auto" if h else "gradient", h),
                "update": Way(True, "update", h) if recipe.dense else None,
            }
            out = {k: [train(p[s], recipe, w, rounds[name], s) for s in seeds] if w else []
                   for k, w in ways.items()}  # fmt: skip
            dense, sparse = out["dense"], out["update"] or out["topk"]
            ratio = (f"{dense[0].bytes_per_agent / sparse[0].bytes_per_agent:.1f}x "
                     f"({dense[0].bytes_per_agent / 1e6:.2f} / "
                     f"{sparse[0].bytes_per_agent / 1e6:.2f} MB)") if dense else "—"  # fmt: skip
            print(f"| {name} | {recipe.name} ({recipe.lr:g} → {recipe.peak_lr:g}) | "
                  f"{_cell(dense)} | {_cell(out['dense_update'])} | {_cell(out['topk'])} | "
                  f"{_cell(out['update'])} | {ratio} |",
                  flush=True)  # fmt: skip
    wall = time.perf_counter() - start
    mode = f"local mode H={h}" if h else "sync mode"
    print(f"\n{AGENTS} agents in-process, iid shards, {mode}, seeds {args.seeds} (mean, then "
          f"each seed); rounds: digits {rounds['digits']} (MLP), mnist1d {rounds['mnist1d']} "
          f"(CNN); batch {BATCH} per agent; base lr for one agent at batch {BATCH}, scaled "
          f"x{AGENTS} (SGD, linear) or x{AGENTS**0.5:g} (AdamW, sqrt) over {WARMUP} warm-up "
          "steps. top-k: group-top-k G=256 k=3, fp16 values, error feedback. Accuracy: "
          "held-out, after the last round (all agents identical unless marked). Bytes: wire "
          "bytes sent per agent incl. frame headers (endpoint.stats.bytes_sent), seed "
          f"{seeds[0]}, dense / agree=update. Wall {wall:.0f} s.")  # fmt: skip


if __name__ == "__main__":
    main()

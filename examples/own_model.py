"""Your own model, loss and DataLoader, trained by four in-process agents with fedring.

What it shows: a user's script drives the engine directly. Each agent, on its own
thread, builds a regression MLP with BatchNorm, wraps `torch.optim.AdamW` in a
`fedring.DistributedOptimizer` and trains with an MSE loss over a
`torch.utils.data.DataLoader` of its quarter of scikit-learn's bundled diabetes
data (offline). AdamW's updates are agreed every step by group-top-k at 1% with
error feedback (the `ReducerSettings` defaults; `SyncSettings.agree`: AdamW steps
on each agent's own gradient) or, with `--dense`, its gradients by a plain fp32 ring;
BatchNorm statistics are averaged every step because the optimizer is given
`model=`. At the end every agent must hold bit-identical parameters.

    python examples/own_model.py [--dense] [--steps 200] [--seed 0]

Compare the two runs: after 200 steps the compressed test R^2 is within
`R2_TOLERANCE` of the dense one (seeds 0-2: 0.59 vs 0.58, 0.46 vs 0.42, 0.38 vs
0.34; diabetes is small and noisy, dense starts to overfit). The wire bytes shrink
only ~2.4x: this model has 897 parameters, so the frame headers of the ring's 2(N-1)
steps and the dense BatchNorm statistics outweigh the gradient payload.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from itertools import islice

import torch
from sklearn.datasets import load_diabetes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fedring
from fedring.training.datasets import Dataset
from fedring.training.models import params_sha256

AGENTS = 4
BATCH = 32  # per agent; one step sees 4 x 32 of the 353 training samples
LR = 2e-3  # AdamW, tuned on the dense run and kept for the compressed one
WEIGHT_DECAY = 1e-2
R2_TOLERANCE = 0.05  # compressed test R^2 within this of dense (the test checks it)


class Regressor(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear, one continuous output."""

    def __init__(self, features: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def load_data(seed: int) -> Dataset:
    """Diabetes, 80/20 split by a seeded permutation, standardised with train statistics."""
    x, y = load_diabetes(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    mx, sx = x[train].mean(0), x[train].std(0)
    my, sy = y[train].mean(), y[train].std()
    return Dataset("diabetes", (x[train] - mx) / sx, (y[train] - my) / sy,
                   (x[test] - mx) / sx, (y[test] - my) / sy, num_classes=0)  # fmt: skip


@torch.no_grad()
def held_out(model: nn.Module, data: Dataset) -> tuple[float, float]:
    """Test MSE (in standardised units) and R^2, in eval mode (running BatchNorm stats)."""
    model.eval()
    mse = float(nn.functional.mse_loss(model(data.x_test), data.y_test))
    return mse, 1.0 - mse / float(data.y_test.var(unbiased=False))


class DiabetesTask:
    """The same work as a fedring task, for agent daemons and a coordinator over MQTT.

    An agent runs it only if its own configuration allows this module
    (``fedring agent --allow-task-module examples.own_model``) or it is installed as
    a package with an entry point in ``fedring.tasks``; the job file names it
    (``task = "examples.own_model:DiabetesTask"``, see ``examples/own_model.toml``) and
    every agent checks its name, version and source sha256 against the coordinator's.
    The metric is the test R^2.
    """

    name = "diabetes-regressor"
    version = "1"

    def dataset(self, seed: int) -> Dataset:
        return load_data(seed)

    def model(self, dataset: Dataset, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # the coordinator's start; agents are sent its parameters
        return Regressor(dataset.feature_shape[0])

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def evaluate(self, model: nn.Module, dataset: Dataset) -> tuple[float, float]:
        return held_out(model, dataset)

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)


def train_agent(
    group: fedring.Group, model: nn.Module, loader: DataLoader, steps: int, dense: bool
) -> int:
    """One agent's loop; returns the wire bytes it sent."""
    numel = sum(p.numel() for p in model.parameters())
    settings = fedring.ReducerSettings(compression="none" if dense else "group-topk")
    reducer = fedring.Reducer(group.collective, numel, settings)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    opt = fedring.DistributedOptimizer(inner, reducer, fedring.SyncSettings(mode="sync"),
                                       model=model)  # fmt: skip
    model.train()
    try:
        for x, y in islice(loader, steps):  # the sampler is endless
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()  # AdamW steps; the group agrees on its update (dense: the gradient)
    except BaseException:
        group.channel.endpoint.close()  # neighbours fail fast instead of waiting out a deadline
        raise
    return group.channel.endpoint.stats.bytes_sent


def main(dense: bool = False, steps: int = 200, seed: int = 0) -> dict[str, float | bool]:
    """Train `AGENTS` agents for `steps` steps; return held-out metrics and the sync check."""
    torch.set_num_threads(1)  # four agent threads: no intra-op threads on top
    data = load_data(seed)
    torch.manual_seed(seed)
    features = data.feature_shape[0]
    start = Regressor(features)
    models = [Regressor(features) for _ in range(AGENTS)]
    for m in models:
        m.load_state_dict(start.state_dict())  # every agent starts from the same parameters
    order = torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(seed))
    loaders = []
    for rank in range(AGENTS):
        shard = order[rank::AGENTS]
        sampler = fedring.ShardSampler(len(shard), batch_size=BATCH, seed=seed, rank=rank)
        pairs = TensorDataset(data.x_train[shard], data.y_train[shard])
        loaders.append(DataLoader(pairs, batch_sampler=sampler))
    groups = fedring.local_group(AGENTS)
    with ThreadPoolExecutor(max_workers=AGENTS) as pool:
        futures = [pool.submit(train_agent, groups[r], models[r], loaders[r], steps, dense)
                   for r in range(AGENTS)]  # fmt: skip
        sent = [f.result() for f in futures]
    initial_mse, initial_r2 = held_out(start, data)
    mse, r2 = held_out(models[0], data)
    return {"test_mse": mse, "r2": r2, "initial_mse": initial_mse, "initial_r2": initial_r2,
            "bytes_sent_per_agent": sum(sent) / AGENTS,
            "identical": len({params_sha256(m) for m in models}) == 1}  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", action="store_true", help="uncompressed fp32 ring (baseline)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = main(args.dense, args.steps, args.seed)
    kind = "dense fp32" if args.dense else "group-top-k 1% + EF"
    print(f"{kind}, {AGENTS} agents, {args.steps} steps: test MSE {out['test_mse']:.3f} "
          f"(untrained {out['initial_mse']:.3f}), R^2 {out['r2']:.3f}, "
          f"{out['bytes_sent_per_agent']:,.0f} bytes sent per agent")  # fmt: skip
    if not out["identical"]:
        raise SystemExit("agents hold different parameters: this is a bug")
    print("all agents hold identical parameters")

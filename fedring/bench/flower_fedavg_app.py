"""The Flower FedAvg baseline's ServerApp and ClientApp (Flower 1.41 Message API).

Plain, dense FedAvg: every round each client receives the global model (fp32),
trains `local-epochs` passes of momentum SGD over its shard and replies with its
model; `flwr.serverapp.strategy.FedAvg` averages the replies weighted by sample
count. Nothing of fedring's compression is involved; fedring supplies only the task
(dataset, iid shard, model and batch order), so the comparison with fedring is
on the same data and the same initial model.

Run config (``flwr run --run-config``; `fedring.bench.flower_fedavg` sets it):

- ``clients``: SuperNodes to wait for and train on every round.
- ``dataset``, ``model``, ``seed``: as in `JobSpec`; the shard of a client is
  ``make_shards(y_train, num-partitions, "iid", seed)[partition-id]`` with both
  ids from the SuperNode's ``--node-config``.
- ``rounds``: most rounds; ``target``: stop once the global model reaches it;
  ``cap-s``: or at the first evaluation after this many seconds (0: no cap).
  Flower 1.41's `Strategy.start` has no early exit, so `TargetFedAvg` sends no
  more messages once the target is reached: the remaining rounds are empty
  loop turns that cost nothing.
- ``lr`` 0.1, tuned on digits with 4 clients, seed 0 (rounds to 0.95 test
  accuracy: 14 at 0.025, 7 at 0.05, 6 at 0.1; 0.2 gets there in 3 but falls
  back to 0.905 the round after), ``momentum`` 0.9, ``batch-size`` 32,
  ``local-epochs`` 1. No x N scaling: FedAvg averages models, not gradients.
- ``out``: directory for ``metrics.jsonl`` (one row per round: ``round``, ``t``
  seconds since round 1 began, ``accuracy``, ``test_loss``; round 0 is the
  initial model at t = 0) and ``summary.json`` (with Flower's message bytes as
  `fedring.flower.metering.MeteredGrid` counts them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedring.engine.local import LocalWork
from fedring.engine.sampler import ShardSampler
from fedring.engine.task import ClassificationTask
from fedring.flower.metering import MeteredGrid
from fedring.training.datasets import Dataset, load_dataset
from fedring.training.models import build_model, param_count
from fedring.training.sharding import make_shards, shard_data

DEFAULTS: dict[str, Any] = {"clients": 2, "dataset": "digits", "model": "mlp", "seed": 0,
                            "rounds": 50, "target": 0.95, "lr": 0.1, "momentum": 0.9,
                            "batch-size": 32, "local-epochs": 1, "round-timeout-s": 300.0,
                            "cap-s": 0.0, "out": ""}  # fmt: skip


def config(context: Context) -> dict[str, Any]:
    """The run config over `DEFAULTS`, each value of its default's type."""
    cfg = dict(DEFAULTS)
    for key, default in DEFAULTS.items():
        if key in context.run_config:
            cfg[key] = type(default)(context.run_config[key])
    return cfg


@lru_cache(maxsize=2)
def dataset(spec: str, seed: int) -> Dataset:
    return load_dataset(spec, seed)


def initial_model(cfg: dict[str, Any]) -> torch.nn.Module:
    ds = dataset(cfg["dataset"], cfg["seed"])
    return build_model(cfg["model"], ds.feature_shape, ds.num_classes, cfg["seed"])


def local_train(
    net: torch.nn.Module, cfg: dict[str, Any], pid: int, n: int, server_round: int
) -> tuple[float, int]:
    """`local-epochs` passes over shard `pid` of `n`; returns (mean loss, shard size).

    The batch order is `ShardSampler`'s, seeded by (seed + round, pid), so it changes
    from round to round; momentum starts from zero every round.
    """
    ds = dataset(cfg["dataset"], cfg["seed"])
    x, y = shard_data(ds, make_shards(ds.y_train.numpy(), n, "iid", cfg["seed"])[pid])
    work = LocalWork(
        net, x, y, F.cross_entropy,
        ShardSampler(len(x), batch_size=cfg["batch-size"], seed=cfg["seed"] + server_round,
                     rank=pid),
        torch.optim.SGD(net.parameters(), lr=cfg["lr"], momentum=cfg["momentum"]),
    )  # fmt: skip
    steps = cfg["local-epochs"] * max(1, len(x) // work.sampler.batch_size)
    losses = work.steps(steps, cfg["lr"])
    return sum(losses) / len(losses), len(x)


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)  # several ClientApps share a few cores
    cfg = config(context)
    net = initial_model(cfg)
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    server_round = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
    loss, size = local_train(net, cfg, pid, n, server_round)
    metrics = MetricRecord({"train_loss": loss, "num-examples": size})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}),
                   reply_to=msg)  # fmt: skip


class TargetFedAvg(FedAvg):
    """FedAvg that sends no more training messages once `reached` is set."""

    reached = False

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.reached:
            return []
        return super().configure_train(server_round, arrays, config, grid)


class Evaluator:
    """Centralized evaluation after every round; writes the rows, sets `reached`."""

    def __init__(self, cfg: dict[str, Any], strategy: TargetFedAvg, out: Path) -> None:
        self.cfg, self.strategy, self.out = cfg, strategy, out
        self.rows: list[dict[str, Any]] = []
        self.start: float | None = None  # set when round 1 begins
        self.net = initial_model(cfg)

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if self.strategy.reached:
            return None
        t = 0.0 if self.start is None else time.perf_counter() - self.start
        self.net.load_state_dict(arrays.to_torch_state_dict())
        ds = dataset(self.cfg["dataset"], self.cfg["seed"])
        loss, acc = ClassificationTask().evaluate(self.net, ds)
        row = {"round": server_round, "t": t, "accuracy": acc, "test_loss": loss}
        self.rows.append(row)
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        capped = self.cfg["cap-s"] > 0 and t >= self.cfg["cap-s"]
        if server_round > 0 and (acc >= self.cfg["target"] or capped):
            self.strategy.reached = True  # no more rounds
        if self.start is None:
            self.start = time.perf_counter()  # round 1 starts right after this evaluation
        return MetricRecord({"accuracy": acc, "loss": loss})


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = config(context)
    out = Path(cfg["out"] or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    n = cfg["clients"]  # FedAvg waits until this many SuperNodes are connected
    strategy = TargetFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n,
                            min_available_nodes=n)  # fmt: skip
    evaluate = Evaluator(cfg, strategy, out)
    metered = MeteredGrid(grid, prompt=False)  # plain Flower: its own waits for replies
    start = time.perf_counter()
    strategy.start(grid=metered, initial_arrays=ArrayRecord(evaluate.net.state_dict()),
                   num_rounds=cfg["rounds"], timeout=cfg["round-timeout-s"],
                   evaluate_fn=evaluate)  # fmt: skip
    last = evaluate.rows[-1]
    reached = next((r for r in evaluate.rows if r["round"] and r["accuracy"] >= cfg["target"]),
                   None)  # fmt: skip
    summary = {"baseline": "flower-fedavg", "clients": n, "dataset": cfg["dataset"],
               "model": cfg["model"], "final_accuracy": last["accuracy"],
               "rounds": last["round"], "target": cfg["target"],
               "seconds_to_target": reached["t"] if reached else None,
               "wall_seconds": time.perf_counter() - start, "params": param_count(evaluate.net),
               "lr": cfg["lr"], "momentum": cfg["momentum"], "batch_size": cfg["batch-size"],
               "local_epochs": cfg["local-epochs"], **metered.totals()}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1))

"""ServerApp: plain Flower FedAvg, except two of the four lines of the adoption: the
import of `CompressedUplinks` and the line marked `fedring`.

Run config: ``clients``, ``num-server-rounds``, ``fraction-train`` (the share of the
nodes FedAvg samples to train each round, 1.0 by default) and ``seed`` (Flower
samples with Python's `random`, seeded here, so a rerun over the same node list
samples the same nodes).
"""

from __future__ import annotations

import random

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.serverapp.strategy.result import Result

from fedring.flower.mod import CompressedUplinks
from flower_app import task

app = ServerApp()


def fedavg(clients: int) -> FedAvg:
    return FedAvg(fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients)


def sample(strategy: FedAvg, fraction: float, seed: int = 0) -> None:
    """Let `strategy` train `fraction` of its nodes a round, int(fraction x nodes) of
    them, drawn by Flower's `random.sample` from the node list, seeded with `seed`."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction-train={fraction} must be in (0, 1]")
    strategy.fraction_train = fraction
    strategy.min_train_nodes = max(1, int(strategy.min_available_nodes * fraction))
    random.seed(seed)


def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    net = task.model()
    net.load_state_dict(arrays.to_torch_state_dict())
    loss, acc = task.evaluate(net)
    return MetricRecord({"loss": loss, "accuracy": acc})


def run(grid: Grid, context: Context, strategy: Strategy) -> Result:
    return strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(task.model().state_dict()),
        num_rounds=int(context.run_config.get("num-server-rounds", 20)),
        evaluate_fn=central_evaluate,
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    clients = int(context.run_config.get("clients", 2))
    strategy = CompressedUplinks(fedavg(clients))  # fedring (plain: strategy = fedavg(clients))
    sample(strategy, float(context.run_config.get("fraction-train", 1.0)),
           int(context.run_config.get("seed", 0)))  # fmt: skip
    run(grid, context, strategy)

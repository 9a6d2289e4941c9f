"""ServerApp: plain Flower FedAvg, except two of the four lines of the adoption: the
import of `CompressedUplinks` and the line marked `fedring`."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.serverapp.strategy.result import Result

from fedring.flower.mod import CompressedUplinks
from flower_app import task

app = ServerApp()


def fedavg(clients: int) -> FedAvg:
    return FedAvg(fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients)


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
    run(grid, context, strategy)

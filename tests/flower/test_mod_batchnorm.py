"""`group_topk_mod` + `CompressedUplinks` on a model with BatchNorm, on Flower's engine.

BatchNorm brings two kinds of buffers: float running statistics, which must be
averaged like the parameters, and the integer `num_batches_tracked`, which FedAvg
turns into a float. This module is also the app the engine test runs: a plain
Flower ClientApp with the mod and a ServerApp with `CompressedUplinks(FedAvg(...))`
(`tests.flower.test_mod_batchnorm:server` / `:client`); the ServerApp writes
accuracy per round, every refused reply and the final global BatchNorm buffers
to ``$FEDRING_FLOWER_OUT/summary.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedring.flower.mod import CompressedUplinks, group_topk_mod
from fedring.flower.simulation import simulate_apps
from fedring.training.datasets import Dataset, load_dataset

ROOT = Path(__file__).resolve().parents[2]
ROUNDS, CLIENTS, STEPS = 6, 2, 10


@lru_cache(maxsize=1)
def _digits() -> Dataset:
    return load_dataset("digits", 0)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(64, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )


def local_train(net: torch.nn.Module, pid: int, n: int, seed: int) -> int:
    """`STEPS` SGD steps on every n-th training sample from `pid`; returns the sample count."""
    ds = _digits()
    x, y = ds.x_train[pid::n], ds.y_train[pid::n]
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed * 100 + pid)
    net.train()
    for _ in range(STEPS):
        idx = torch.randint(len(y), (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    return len(y)


def accuracy(arrays: ArrayRecord) -> float:
    net = model()
    net.load_state_dict(arrays.to_torch_state_dict())
    net.eval()
    ds = _digits()
    with torch.no_grad():
        return float((net(ds.x_test).argmax(1) == ds.y_test).float().mean())


client = ClientApp(mods=[group_topk_mod])


@client.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    net = model()
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    server_round = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
    examples = local_train(net, pid, n, server_round)
    content = RecordDict(
        {
            "arrays": ArrayRecord(net.state_dict()),
            "metrics": MetricRecord({"num-examples": examples}),
        }
    )
    return Message(content, reply_to=msg)


class RefusalLog(FedAvg):
    """FedAvg that notes every error reply it is handed (a refused reply is one)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.refused: list[str] = []

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.refused += [
            f"round {server_round}: {r.error.reason}" for r in replies if r.has_error()
        ]
        return super().aggregate_train(server_round, replies)


def strategy(clients: int) -> tuple[CompressedUplinks, RefusalLog]:
    inner = RefusalLog(fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients)
    return CompressedUplinks(inner), inner


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    outer, inner = strategy(CLIENTS)
    result = outer.start(
        grid=grid,
        initial_arrays=ArrayRecord(model().state_dict()),
        num_rounds=ROUNDS,
        evaluate_fn=lambda rnd, arrays: MetricRecord({"accuracy": accuracy(arrays)}),
    )
    final = result.arrays
    summary = {
        "accuracy": {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()},  # type: ignore[arg-type]
        "refused": inner.refused,
        "bn_count_dtype": final["2.num_batches_tracked"].dtype,
        "bn_count": final["2.num_batches_tracked"].numpy().tolist(),
        "bn_mean_abs": float(np.abs(final["2.running_mean"].numpy()).mean()),
        "bn_var_dev": float(np.abs(final["2.running_var"].numpy() - 1.0).mean()),
    }
    out = Path(os.environ.get("FEDRING_FLOWER_OUT", "."))
    (out / "summary.json").write_text(json.dumps(summary, sort_keys=True))


def test_a_batchnorm_model_keeps_learning_with_compressed_uplinks(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    s = simulate_apps(
        "tests.flower.test_mod_batchnorm:server",
        "tests.flower.test_mod_batchnorm:client",
        CLIENTS,
        tmp_path,
        timeout_s=240,
        cpus=2,
        env=env,
    )
    print({k: s[k] for k in ("accuracy", "bn_count", "bn_mean_abs", "bn_var_dev")})
    acc = {int(r): a for r, a in s["accuracy"].items()}
    assert s["refused"] == []
    assert acc[ROUNDS] > acc[1] + 0.1, acc
    # the running statistics travelled (they start at 0 and 1) ...
    assert s["bn_mean_abs"] > 0.01 and s["bn_var_dev"] > 0.01
    # ... and the step counter is still an integer: ROUNDS times STEPS batches
    assert s["bn_count_dtype"] == "int64" and s["bn_count"] == ROUNDS * STEPS

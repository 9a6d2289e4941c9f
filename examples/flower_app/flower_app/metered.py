"""The same app, plain and with fedring's four lines, with the ServerApp's grid metered.

For `bench/flower_vs_fedavg.py`, `bench/flower_sampling.py` and the tests: both
variants share `client_app.train`, `server_app.fedavg`, `server_app.sample` and
`server_app.run`; only the adoption lines differ. The ServerApp writes accuracy, the
bytes counted on the messages (deflated Flower objects, as `fedring.flower.metering`
explains) and the partitions that trained each round to
``$FEDRING_FLOWER_OUT/summary.json``.

Environment variables stand in for the run config, which the engine's
`run_simulation` does not pass:

- ``FEDRING_FLOWER_ROUNDS``, ``FEDRING_FLOWER_CLIENTS`` (default 2);
- ``FEDRING_FLOWER_FRACTION`` (default 1.0): FedAvg's ``fraction_train``, Flower's
  own sampling, seeded with ``FEDRING_FLOWER_SEED`` (default 0). The simulation
  engine gives its nodes random ids, so before the first round the ServerApp asks
  every node its partition id (a query message, not metered) and lists the nodes
  to FedAvg in partition order: the plain and the compressed run then train the
  same partitions each round (``summary["trained"]`` lists them);
- ``FEDRING_FLOWER_LOCAL_STEPS``: the clients' local steps (the app's run config: 12);
- ``FEDRING_FLOWER_SIT_OUT``, ``FEDRING_FLOWER_DENSITY``: the compressed client's
  ``make_group_topk_mod(sit_out=..., density=...)``; unset, it is `group_topk_mod`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedring.flower.metering import MeteredGrid
from fedring.flower.mod import CompressedUplinks, group_topk_mod, make_group_topk_mod
from flower_app import client_app, server_app

PARTITION = "partition"  # the query's reply record


def _mod_options() -> dict[str, Any]:
    options: dict[str, Any] = {}
    if "FEDRING_FLOWER_SIT_OUT" in os.environ:
        options["sit_out"] = os.environ["FEDRING_FLOWER_SIT_OUT"]
    if "FEDRING_FLOWER_DENSITY" in os.environ:
        value = os.environ["FEDRING_FLOWER_DENSITY"]
        options["density"] = value if value == "auto" else float(value)
    return options


def partition(msg: Message, context: Context) -> Message:
    """Answer the ServerApp's query with this node's partition id."""
    pid = int(context.node_config["partition-id"])
    return Message(RecordDict({PARTITION: ConfigRecord({"id": pid})}), reply_to=msg)


plain_client = ClientApp()


def train(msg: Message, context: Context) -> Message:
    """The app's train, with ``FEDRING_FLOWER_LOCAL_STEPS`` for its local steps."""
    if "FEDRING_FLOWER_LOCAL_STEPS" in os.environ:  # a node's run_config is read-only
        run_config = {**context.run_config,
                      "local-steps": int(os.environ["FEDRING_FLOWER_LOCAL_STEPS"])}  # fmt: skip
        context = Context(context.run_id, context.node_id, context.node_config,
                          context.state, run_config)  # fmt: skip
    return client_app.train(msg, context)


plain_client.train()(train)
plain_client.query()(partition)
_options = _mod_options()
_mod = make_group_topk_mod(**_options) if _options else group_topk_mod
compressed_client = ClientApp(mods=[_mod])
compressed_client.train()(train)
compressed_client.query()(partition)


def partitions(grid: Grid, clients: int, wait_s: float = 120.0) -> dict[int, int]:
    """node id -> partition id of every node, asked once all `clients` are online."""
    deadline = time.monotonic() + wait_s
    while len(nodes := list(grid.get_node_ids())) < clients:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(nodes)} of {clients} nodes online after {wait_s:.0f} s")
        time.sleep(0.2)
    asks = [grid.create_message(RecordDict(), "query", n, "partitions") for n in nodes]
    replies = list(grid.send_and_receive(asks))
    ids = {
        r.metadata.src_node_id: int(r.content.config_records[PARTITION]["id"])  # type: ignore[arg-type]
        for r in replies
        if not r.has_error()
    }
    if len(ids) != len(nodes):
        raise RuntimeError(f"{len(ids)} of {len(nodes)} nodes told their partition id")
    return ids


class PartitionOrderedGrid(MeteredGrid):
    """A metered grid listing its nodes in partition order, so that Flower's seeded
    `random.sample` draws the same partitions in every run; `trained` keeps the
    partitions sent each train round."""

    def __init__(self, inner: Grid, ids: dict[int, int]) -> None:
        super().__init__(inner)
        self.ids = ids
        self.trained: list[list[int]] = []

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.inner.get_node_ids(), key=lambda n: self.ids.get(n, len(self.ids)))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        out = list(messages)
        if out and out[0].metadata.message_type.split(".")[0] == "train":
            self.trained.append(sorted(self.ids[m.metadata.dst_node_id] for m in out))
        return super().send_and_receive(out, timeout=timeout)


def _server(compressed: bool) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        start = time.perf_counter()
        if "FEDRING_FLOWER_ROUNDS" in os.environ:
            context.run_config["num-server-rounds"] = int(os.environ["FEDRING_FLOWER_ROUNDS"])
        clients = int(os.environ.get("FEDRING_FLOWER_CLIENTS", "2"))
        fraction = float(os.environ.get("FEDRING_FLOWER_FRACTION", "1.0"))
        metered = PartitionOrderedGrid(grid, partitions(grid, clients))
        strategy = server_app.fedavg(clients)
        server_app.sample(strategy, fraction, int(os.environ.get("FEDRING_FLOWER_SEED", "0")))
        result = server_app.run(
            metered, context, CompressedUplinks(strategy) if compressed else strategy
        )
        evals = result.evaluate_metrics_serverapp
        last = evals[max(evals)]
        summary = {
            "status": "completed",
            "variant": "compressed" if compressed else "plain",
            "final_accuracy": float(last["accuracy"]),  # type: ignore[arg-type]
            "accuracy": {str(r): float(m["accuracy"]) for r, m in evals.items()},  # type: ignore[arg-type]
            "rounds": max(evals),
            "clients": len(metered.up),
            "fraction_train": fraction,
            "trained": metered.trained,
            "wall_seconds": time.perf_counter() - start,
            **metered.totals(),
        }
        out = Path(os.environ.get("FEDRING_FLOWER_OUT", "."))
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, sort_keys=True))

    return app


plain_server = _server(compressed=False)
compressed_server = _server(compressed=True)

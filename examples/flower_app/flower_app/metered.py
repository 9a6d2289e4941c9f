"""The same app, plain and with fedring's four lines, with the ServerApp's grid metered.

For `bench/flower_vs_fedavg.py` and the tests: both variants share `client_app.train`,
`server_app.fedavg` and `server_app.run`; only the adoption lines differ. The
ServerApp writes accuracy and the bytes counted on the messages (deflated Flower
objects, as `fedring.flower.metering` explains) to ``$FEDRING_FLOWER_OUT/summary.json``.
``FEDRING_FLOWER_ROUNDS`` and ``FEDRING_FLOWER_CLIENTS`` stand in for the run
config, which the engine's `run_simulation` does not pass.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedring.flower.metering import MeteredGrid
from fedring.flower.mod import CompressedUplinks, group_topk_mod
from flower_app import client_app, server_app

plain_client = ClientApp()
plain_client.train()(client_app.train)
compressed_client = ClientApp(mods=[group_topk_mod])
compressed_client.train()(client_app.train)


def _server(compressed: bool) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        start = time.perf_counter()
        if "FEDRING_FLOWER_ROUNDS" in os.environ:
            context.run_config["num-server-rounds"] = int(os.environ["FEDRING_FLOWER_ROUNDS"])
        metered = MeteredGrid(grid)
        clients = int(os.environ.get("FEDRING_FLOWER_CLIENTS", "2"))
        strategy = server_app.fedavg(clients)
        result = server_app.run(
            metered, context, CompressedUplinks(strategy) if compressed else strategy
        )
        evals = result.evaluate_metrics_serverapp
        last = evals[max(evals)]
        summary = {
            "status": "completed",
            "variant": "compressed" if compressed else "plain",
            "final_accuracy": float(last["accuracy"]),  # type: ignore[arg-type]
            "rounds": max(evals),
            "clients": len(metered.up),
            "wall_seconds": time.perf_counter() - start,
            **metered.totals(),
        }
        out = Path(os.environ.get("FEDRING_FLOWER_OUT", "."))
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, sort_keys=True))

    return app


plain_server = _server(compressed=False)
compressed_server = _server(compressed=True)

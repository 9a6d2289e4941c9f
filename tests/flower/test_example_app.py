"""examples/flower_app: a plain Flower FedAvg app plus two fedring lines, on the engine."""

from __future__ import annotations

import os
from pathlib import Path

from fedring.flower.simulation import simulate_apps

APP = Path(__file__).resolve().parents[2] / "examples" / "flower_app"
PARAMS = 17_226  # the digits MLP


def test_the_app_differs_from_plain_flower_by_two_lines() -> None:
    code = {
        n: (APP / "flower_app" / n).read_text().splitlines()
        for n in ("client_app.py", "server_app.py")
    }
    uses = [
        (name, line.strip())
        for name, lines in code.items()
        for line in lines
        if ("group_topk_mod" in line or "CompressedUplinks" in line)
        and not line.startswith("from ")
    ]
    assert uses == [
        (
            "client_app.py",
            "app = ClientApp(mods=[group_topk_mod])  # fedring: compressed uplinks "
            "(plain: ClientApp())",
        ),
        (
            "server_app.py",
            "strategy = CompressedUplinks(fedavg(clients))  # fedring "
            "(plain: strategy = fedavg(clients))",
        ),
    ]


def test_the_two_line_app_runs_on_the_simulation_engine(tmp_path: Path) -> None:
    rounds, clients = 3, 3
    env = {
        "PYTHONPATH": os.pathsep.join([str(APP), os.environ.get("PYTHONPATH", "")]),
        "FEDRING_FLOWER_ROUNDS": str(rounds),
        "FEDRING_FLOWER_CLIENTS": str(clients),
    }
    s = simulate_apps(
        "flower_app.metered:compressed_server",
        "flower_app.metered:compressed_client",
        clients,
        tmp_path,
        timeout_s=240,
        cpus=2,
        env=env,
    )
    assert s["status"] == "completed" and s["rounds"] == rounds and s["clients"] == clients
    assert s["final_accuracy"] > 0.3  # the initial model scores ~0.07
    dense_up = PARAMS * 4 * rounds
    assert 0 < s["uplink_bytes_per_client"] * 30 < dense_up  # compressed replies
    assert s["downlink_bytes_per_client"] > dense_up  # FedAvg still sends dense models down

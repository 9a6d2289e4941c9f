"""examples/flower_app: a plain Flower FedAvg app plus four fedring lines, on the engine."""

from __future__ import annotations

import os
from pathlib import Path

from fedring.flower.simulation import simulate_apps

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "flower_app"
WORDS = ("fedring", "group_topk_mod", "CompressedUplinks")  # what an adoption line names
PARAMS = 17_226  # the digits MLP


def test_the_app_differs_from_plain_flower_by_four_lines_as_the_docs_say() -> None:
    code = {
        n: (APP / "flower_app" / n).read_text().split("from __future__ import annotations")
        for n in ("client_app.py", "server_app.py")
    }  # docstring, code
    fedring_lines = [
        (name, line.strip())
        for name, (_, body) in code.items()
        for line in body.splitlines()
        if any(word in line.split("#")[0] for word in WORDS)
    ]
    assert fedring_lines == [
        ("client_app.py", "from fedring.flower.mod import group_topk_mod"),
        (
            "client_app.py",
            "app = ClientApp(mods=[group_topk_mod])  # fedring: compressed uplinks "
            "(plain: ClientApp())",
        ),
        ("server_app.py", "from fedring.flower.mod import CompressedUplinks"),
        (
            "server_app.py",
            "strategy = CompressedUplinks(fedavg(clients))  # fedring "
            "(plain: strategy = fedavg(clients))",
        ),
    ]
    # an import and an edit in each file: every place that describes the adoption says four
    for where, text in [
        ("docs/quickstart/flower.md", (ROOT / "docs" / "quickstart" / "flower.md").read_text()),
        ("README.md", (ROOT / "README.md").read_text()),
        ("docs/flower.md", (ROOT / "docs" / "flower.md").read_text()),
        ("the example", "\n".join([(APP / "pyproject.toml").read_text(),
                                    (APP / "flower_app" / "__init__.py").read_text(),
                                    *("".join(parts) for parts in code.values())])),
    ]:  # fmt: skip
        assert "two line" not in text.lower() and "two-line" not in text.lower(), where
        assert "four lines" in text, where


def test_the_adopting_app_runs_on_the_simulation_engine(tmp_path: Path) -> None:
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
    # compressed replies: density auto sends 37% in a 3-round run (at least 2.5x fewer bytes)
    assert 0 < s["uplink_bytes_per_client"] * 2.5 < dense_up
    assert s["downlink_bytes_per_client"] > dense_up  # FedAvg still sends dense models down

"""The edge-lab bench: `python bench/edge_lab.py [OPTIONS]` is `fedring bench lab [OPTIONS]`.

Needs root. Runs fedring's compressed (sync and local) and dense rings over MQTT,
Flower FedAvg on SuperLink/SuperNodes and gloo DDP on the same shaped links, and
prints time to target, bytes per agent and final accuracy; see docs/lab.md.
"""

from __future__ import annotations

import sys

from fedring.cli import app

if __name__ == "__main__":
    app(["bench", "lab", *sys.argv[1:]])

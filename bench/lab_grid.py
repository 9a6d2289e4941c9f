"""The lab grid: `python bench/lab_grid.py [OPTIONS]` is `fedring bench grid [OPTIONS]`.

Needs root. Runs every method (fedring's group-top-k collectives ring, fanout, hub and
auto; the dense ring, Flower FedAvg, gloo DDP, DDP + PowerSGD rank 2 and 4) in every
cell of N x bandwidth x delay x model, each run capped, on the same shaped links, and
writes grid.json, grid.md and grid.png; see docs/lab.md.
"""

from __future__ import annotations

import sys

from fedring.cli import app

if __name__ == "__main__":
    app(["bench", "grid", *sys.argv[1:]])

"""The grid's methods and their labels: what `lab_grid` runs and `lab_grid_report`
draws, apart from both so that neither imports the other's module for them."""

from __future__ import annotations

PEERS = ("dense", "flower", "ddp", "powersgd2", "powersgd4")
COMPRESSED = ("ring", "fanout", "hub", "auto", "auto-codec")  # auto-codec: compression auto
METHODS = (*COMPRESSED, *PEERS)
LABELS = {"ring": "ring", "fanout": "fanout", "hub": "hub", "auto": "auto",
          "auto-codec": "auto (codec too)",
          "dense": "dense ring", "flower": "Flower FedAvg", "ddp": "DDP gloo",
          "powersgd2": "DDP+PowerSGD r2", "powersgd4": "DDP+PowerSGD r4"}  # fmt: skip

"""Accuracy benches: the same job under several settings, each over the same seeds.

`compare` runs every setting for every seed and sets each beside the first one
(the dense baseline): mean, min and max accuracy, bytes per agent, the gap in
percentage points and how many times fewer bytes. `print_table` prints that.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

from fedring.config import JobSpec
from fedring.sim.runner import simulate


def compare(
    base: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]], seeds: list[int]
) -> dict[str, dict[str, float]]:
    """One row per run: ``JobSpec(**base, **changes, seed=s)`` for every seed."""
    table: dict[str, dict[str, float]] = {}
    for name, changes in runs.items():
        accs, sent = [], []
        start = time.perf_counter()
        for seed in seeds:
            s = simulate(JobSpec.from_mapping({**base, **changes, "seed": seed}))
            accs.append(s["final_accuracy"])
            sent.append(s["bytes_sent_per_agent"])
        table[name] = {
            "accuracy_mean": statistics.mean(accs),
            "accuracy_min": min(accs),
            "accuracy_max": max(accs),
            "bytes_per_agent": statistics.mean(sent),
            "seconds": time.perf_counter() - start,
        }
    first = next(iter(table.values()))
    for row in table.values():
        row["pp_vs_dense"] = 100 * (row["accuracy_mean"] - first["accuracy_mean"])
        row["bytes_ratio_vs_dense"] = first["bytes_per_agent"] / row["bytes_per_agent"]
    return table


def print_table(title: str, table: Mapping[str, Mapping[str, float]]) -> None:
    width = max(len(name) for name in table) + 2
    print(title)
    head = ("", "accuracy mean [min, max]", "pp vs dense", "bytes/agent", "x fewer")
    print(f"{head[0]:{width}} {head[1]:>28} {head[2]:>12} {head[3]:>13} {head[4]:>8}")
    for name, r in table.items():
        acc = f"{r['accuracy_mean']:.4f} [{r['accuracy_min']:.4f}, {r['accuracy_max']:.4f}]"
        print(f"{name:{width}} {acc:>28} {r['pp_vs_dense']:>+12.2f} "
              f"{r['bytes_per_agent']:>13,.0f} {r['bytes_ratio_vs_dense']:>8.1f}")  # fmt: skip

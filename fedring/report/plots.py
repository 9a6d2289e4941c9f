"""The PNG plots of a run's report, several runs on the same axes.

`plot_runs` takes the per-round rows of one or more runs (the rows of
`fedring simulate`'s summary, or the coordinator's metrics) and draws:

- ``curves_rounds.png``: training loss and test accuracy against rounds;
- ``curves_sim_seconds.png``: the same against simulated seconds (rows with
  ``sim_seconds``, from ``--fleet``);
- ``bytes_per_round.png``: bytes each agent sent per round (log scale);
- ``compression.png``: compression error ``||g - sent|| / ||g||`` and gradient norm.

A plot whose data no run has is left out. Figures are drawn with matplotlib's
object API on the Agg canvas: no display, no pyplot global state, safe in threads.
Importing this module loads matplotlib (over a second on a 2-core machine), so
`fedring.report.markdown` imports it only when it draws.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

Rows = Sequence[Mapping[str, Any]]
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def _series(rows: Rows, x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [
        (float(r[x]), float(r[y]))
        for r in rows
        if x in r and y in r and r[y] is not None and math.isfinite(float(r[y]))
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def _per_round_bytes(rows: Rows) -> list[dict[str, Any]]:
    """Per-round bytes from a cumulative counter. Where the counter restarts (an MQTT
    ring re-formed with another head, whose count it then is) the round is left out."""
    out, before = [], 0.0
    for r in rows:
        if "bytes_sent" in r:
            sent = float(r["bytes_sent"])
            if sent > before:
                out.append({"round": r["round"], "bytes": sent - before})
            before = sent
    return out


def _panel(
    fig: Figure, pos: int, runs: Mapping[str, Rows], x: str, y: str, ylabel: str, *,
    log: bool = False, xlabel: str = "round",
) -> bool:  # fmt: skip
    ax = fig.add_subplot(1, 2, pos) if pos else fig.add_subplot(1, 1, 1)
    drawn = False
    for i, (name, rows) in enumerate(runs.items()):
        xs, ys = _series(rows, x, y)
        if xs:
            marker = "o" if len(xs) <= 60 else None
            ax.plot(xs, ys, label=name, color=COLOURS[i % len(COLOURS)], marker=marker,
                    markersize=3, linewidth=1.4)  # fmt: skip
            drawn = True
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if log and drawn:
        ax.set_yscale("log")
    if drawn:
        ax.legend(fontsize=8)
    return drawn


def _save(fig: Figure, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)


def _pair(
    out: Path, name: str, title: str, runs: Mapping[str, Rows],
    left: tuple[str, str, str], right: tuple[str, str, str], xlabel: str = "round",
    log_left: bool = False,
) -> Path | None:  # fmt: skip
    fig = Figure(figsize=(11, 4), layout="constrained")
    fig.suptitle(title)
    a = _panel(fig, 1, runs, *left, log=log_left, xlabel=xlabel)
    b = _panel(fig, 2, runs, *right, xlabel=xlabel)
    if not (a or b):
        return None
    path = out / name
    _save(fig, path)
    return path


def plot_runs(out: Path, runs: Mapping[str, Rows]) -> dict[str, Path]:
    """Draw every plot some run has data for; return them by name."""
    plots: dict[str, Path | None] = {
        "curves_rounds": _pair(out, "curves_rounds.png", "Training loss and test accuracy",
                               runs, ("round", "loss", "training loss (mean over agents)"),
                               ("round", "accuracy", "test accuracy"), log_left=True),
        "curves_sim_seconds": _pair(out, "curves_sim_seconds.png",
                                    "Against simulated wall time on the fleet", runs,
                                    ("sim_seconds", "loss", "training loss"),
                                    ("sim_seconds", "accuracy", "test accuracy"),
                                    xlabel="simulated seconds", log_left=True),
        "compression": _pair(out, "compression.png", "Compression error and gradient norm",
                             runs, ("round", "compression_error", "||g - sent|| / ||g||"),
                             ("round", "grad_norm", "local gradient norm")),
    }  # fmt: skip
    fig = Figure(figsize=(7, 4), layout="constrained")
    fig.suptitle("Bytes each agent sent per round (frames included)")
    per_round = {name: _per_round_bytes(rows) for name, rows in runs.items()}
    if _panel(fig, 0, per_round, "round", "bytes", "bytes per round", log=True):
        plots["bytes_per_round"] = out / "bytes_per_round.png"
        _save(fig, out / "bytes_per_round.png")
    return {k: v for k, v in plots.items() if v is not None}

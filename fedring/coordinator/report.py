"""A run's report: ``report.md`` with PNG plots, dense beside compressed when both ran.

`write_report` takes the per-round rows of one or more runs (the rows of
`fedring simulate`'s summary, or the coordinator's metrics) and writes:

- ``curves_rounds.png``: training loss and test accuracy against rounds;
- ``curves_sim_seconds.png``: the same against simulated seconds (rows with
  ``sim_seconds``, from ``--fleet``);
- ``bytes_per_round.png``: bytes each agent sent per round (log scale);
- ``compression.png``: compression error ``||g - sent|| / ||g||`` and gradient norm;
- ``report.md``: a table of the runs' figures, then the plots.

A plot whose data no run has is left out. Figures are drawn with matplotlib's
object API on the Agg canvas: no display, no pyplot global state, safe in threads.
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


CAPTIONS = {
    "curves_rounds": "Training loss (log scale) and test accuracy against rounds.",
    "curves_sim_seconds": "The same against simulated seconds on the fleet (virtual clock).",
    "bytes_per_round": "Bytes each agent sent per round, frames included (log scale).",
    "compression": "Compression error ||g - sent|| / ||g|| (0 for a dense ring) "
    "and the local gradient norm.",
}
FACTS = (
    ("final accuracy", "final_accuracy", "{:.4f}"),
    ("rounds", "rounds", "{}"),
    ("bytes sent per agent", "bytes_sent_per_agent", "{:,.0f}"),
    ("dense fp32 ring would send", "dense_equivalent_bytes", "{:,.0f}"),
    ("wall seconds (this machine)", "wall_seconds", "{:.1f}"),
    ("fleet", "fleet", "{}"),
    ("simulated seconds", "sim_seconds", "{:.1f}"),
    ("simulated seconds to target", "sim_seconds_to_target", "{:.1f}"),
    ("rounds to target", "sim_rounds_to_target", "{}"),
)


def write_report(
    out: Path,
    runs: Mapping[str, Rows],
    *,
    title: str = "fedring run",
    summaries: Mapping[str, Mapping[str, Any]] | None = None,
    notes: Sequence[str] = (),
) -> dict[str, str]:
    """Write ``report.md`` and its PNG plots under `out`; return their paths by name.

    Parameters
    ----------
    out : Path
        Folder (created when missing).
    runs : mapping of run name to rows
        Per-round rows with ``round`` and any of ``loss``, ``accuracy``,
        ``bytes_sent`` (cumulative per agent), ``compression_error``, ``grad_norm``,
        ``sim_seconds``. Several runs are drawn on the same axes.
    summaries : mapping of run name to summary, optional
        Figures for the table (`FACTS`); missing ones show as "-".
    notes : lines added under the title (e.g. the ONNX export's result).
    """
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_runs(out, runs)
    lines = [f"# {title}", ""]
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    if summaries:
        names = list(summaries)
        lines += ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for label, key, fmt in FACTS:
            cells = [_fmt(summaries[n].get(key), fmt) for n in names]
            if any(c != "-" for c in cells):
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    for name, path in plots.items():
        lines += [f"## {name.replace('_', ' ')}", "", CAPTIONS[name], "", f"![{name}]({path.name})",
                  ""]  # fmt: skip
    report = out / "report.md"
    tmp = out / ".report.md.tmp"
    tmp.write_text("\n".join(lines))
    os.replace(tmp, report)
    return {"report": str(report), **{k: str(v) for k, v in plots.items()}}


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)

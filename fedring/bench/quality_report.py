"""The table and the plot of `fedring bench quality`, from ``quality.json``'s rows.

Per regime and method: the accuracy's mean and spread (min to max) over the seeds,
its difference from the dense twin taken seed by seed, the uplink bytes an agent
sent and how many times fewer than dense. The attack table sets each rule under
each attack beside the attack-free mean of the same seed.

    >>> rows = [{"table": "main", "regime": "r", "title": "R", "method": m, "seed": 0,
    ...          "accuracy": a, "uplink_bytes": b} for m, a, b in
    ...         (("dense", 0.9, 1000.0), ("auto", 0.895, 50.0))]
    >>> [(c.method, round(c.gap_pp, 2), c.saving) for c in cells(rows, "main")]
    [('dense', 0.0, 1.0), ('auto', -0.5, 20.0)]
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]
BASELINE = {"main": "dense", "frontier": "dense", "attack": "mean, no attack"}


@dataclass(frozen=True)
class Cell:
    regime: str
    title: str
    method: str
    seeds: int
    accuracy: float  # mean over the seeds
    low: float
    high: float
    gap_pp: float  # mean of (accuracy - baseline's, same seed) in pp
    uplink_bytes: float
    saving: float  # baseline's bytes / these (x fewer)

    @property
    def goal(self) -> str:
        """Within 1 pp of dense and at least 10x fewer bytes: both, or which holds."""
        acc, few = self.gap_pp >= -1.0, self.saving >= 10.0
        return "both" if acc and few else "1 pp only" if acc else "10x only" if few else "neither"


def cells(rows: Sequence[Row], table: str) -> list[Cell]:
    """The cells of `table`, in the order first run; baselines from the main table."""
    base_table = "main" if table in ("main", "frontier") else table
    base = {(r["regime"], r["seed"]): r for r in rows
            if r["table"] == base_table and r["method"] == BASELINE[table]}  # fmt: skip
    keys: list[tuple[str, str]] = []
    for r in rows:
        if r["table"] == table and (r["regime"], r["method"]) not in keys:
            keys.append((r["regime"], r["method"]))
    regimes = list(dict.fromkeys(regime for regime, _ in keys))  # grouped, in order first run
    keys.sort(key=lambda k: regimes.index(k[0]))
    out = []
    for regime, method in keys:
        got = [r for r in rows if r["table"] == table and (r["regime"], r["method"]) == (
            regime, method)]  # fmt: skip
        paired = [(r, base[(regime, r["seed"])]) for r in got if (regime, r["seed"]) in base]
        accs = [r["accuracy"] for r in got]
        gap = statistics.fmean(100 * (r["accuracy"] - b["accuracy"]) for r, b in paired) \
            if paired else float("nan")  # fmt: skip
        saving = statistics.fmean(b["uplink_bytes"] / r["uplink_bytes"] for r, b in paired) \
            if paired else float("nan")  # fmt: skip
        out.append(Cell(regime, got[0]["title"], method, len(got), statistics.fmean(accs),
                        min(accs), max(accs), gap,
                        statistics.fmean(r["uplink_bytes"] for r in got), saving))  # fmt: skip
    return out


def markdown(rows: Sequence[Row]) -> str:
    """The tables: main (regime x method), the frontier, the attacks."""
    parts = []
    for table, head in (("main", "Regime x method"), ("frontier", "Frontier: fixed densities "
                        "sized for 5x to 50x fewer bytes"), ("attack", "Attacks")):  # fmt: skip
        got = cells(rows, table)
        if not got:
            continue
        attack = table == "attack"
        vs = "vs attack-free mean" if attack else "vs dense"
        tail = "" if attack else " x fewer | goal |"
        parts += [f"## {head}", "",
                  f"| regime | method | seeds | accuracy (min-max) | {vs} | uplink B/agent |"
                  + tail, "|---|---|---|---|---|---|" + ("" if attack else "---|---|")]  # fmt: skip
        for c in got:
            goal = c.goal if table == "main" and c.method != "dense" else ""
            parts.append(
                f"| {c.title} | {c.method} | {c.seeds} | {c.accuracy:.4f} ({c.low:.4f}-"
                f"{c.high:.4f}) | {c.gap_pp:+.2f} pp | {c.uplink_bytes:,.0f} |"
                + ("" if attack else f" {c.saving:.1f} | {goal} |")
            )
        parts.append("")
    return "\n".join(parts)


def plot(rows: Sequence[Row], path: Path) -> None:
    """Accuracy against dense (pp) and x fewer bytes, per regime and method."""
    from matplotlib.figure import Figure

    got = [c for c in cells(rows, "main") if c.method != "dense"]
    if not got:
        return
    regimes = list(dict.fromkeys(c.regime for c in got))
    methods = list(dict.fromkeys(c.method for c in got))
    fig = Figure(figsize=(11, 7), layout="constrained")
    acc_ax, byte_ax = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        by = {c.regime: c for c in got if c.method == method}
        xs = [j + i * width for j, r in enumerate(regimes) if r in by]
        acc_ax.bar(xs, [by[r].gap_pp for r in regimes if r in by], width, label=method)
        byte_ax.bar(xs, [by[r].saving for r in regimes if r in by], width, label=method)
    for ax in (acc_ax, byte_ax):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(regimes))], regimes,
                      rotation=20, ha="right")  # fmt: skip
    acc_ax.axhline(-1.0, color="grey", linestyle="--", linewidth=0.8)
    acc_ax.set_ylabel("accuracy vs dense twin (pp)")
    acc_ax.legend()
    byte_ax.axhline(10.0, color="grey", linestyle="--", linewidth=0.8)
    byte_ax.set_yscale("log")
    byte_ax.set_ylabel("x fewer uplink bytes than dense")
    fig.suptitle("fedring bench quality: mean over seeds")
    fig.savefig(path, dpi=110)


def write(rows: Sequence[Row], out: Path) -> None:
    (out / "quality.md").write_text("# fedring bench quality\n\n" + markdown(rows))
    plot(rows, out / "quality.png")

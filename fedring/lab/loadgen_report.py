"""Fleet-scale results as a table, and their cost against N fitted linear and quadratic.

`fit` takes one figure measured at several N and fits ``a + b N`` and ``a + b N + c N^2``
by least squares; `Fit.quadratic_share` says how much of the figure at a given N the
N^2 term carries (near 0: linear; an O(N^2) step shows as a share that grows with N).

    >>> f = fit([100, 300, 1000], [1.0, 3.0, 10.0])
    >>> round(f.b, 4), round(f.quadratic_share(1000), 3)
    (0.01, 0.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# (column, key in a scenario's row, per round?)
FIGURES = (
    ("enrolment s", "enrol_s", False),
    ("after the last hello s", "enrol_after_hellos_s", False),
    ("coordinator CPU s, enrolment", "coordinator_cpu_enrol_s", False),
    ("coordinator CPU ms / round", "coordinator_cpu_rounds_s", True),
    ("broker CPU ms / round", "broker_cpu_rounds_s", True),
    ("wall ms / round", "train_s", True),
    ("coordinator peak RSS MB", "coordinator_rss_mb", False),
)


@dataclass(frozen=True)
class Fit:
    """``a + b N`` (linear) and ``qa + qb N + qc N^2`` (quadratic), least squares."""

    a: float
    b: float
    qa: float
    qb: float
    qc: float

    def linear(self, n: float) -> float:
        return self.a + self.b * n

    def quadratic(self, n: float) -> float:
        return self.qa + self.qb * n + self.qc * n * n

    def quadratic_share(self, n: float) -> float:
        """The N^2 term's part of the quadratic fit at `n`, by magnitude: |c| N^2 over
        |a| + |b| N + |c| N^2 (in [0, 1]; noise in a small figure shows as a share too)."""
        terms = abs(self.qa), abs(self.qb * n), abs(self.qc * n * n)
        return terms[2] / sum(terms) if sum(terms) > 0 else 0.0


def fit(ns: Sequence[float], values: Sequence[float]) -> Fit:
    """Least-squares fits of `values` against `ns` (3 points at least for the quadratic)."""
    if len(ns) != len(values) or len(ns) < 2:
        raise ValueError(f"fit needs as many values as N, 2 at least: {len(ns)} N, {len(values)}")
    n = np.asarray(ns, dtype=float)
    y = np.asarray(values, dtype=float)
    a, b = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), y, rcond=None)[0]
    if len(ns) >= 3:
        qa, qb, qc = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], 1), y, rcond=None)[0]
    else:
        qa, qb, qc = a, b, 0.0
    return Fit(float(a), float(b), float(qa), float(qb), float(qc))


def value(row: dict[str, Any], key: str, per_round: bool) -> float:
    """A row's figure; per round (ms) where asked."""
    v = float(row[key] or 0.0)
    return 1000.0 * v / max(int(row["rounds"]), 1) if per_round else v


# A scenario's figures that `median_row` takes the median of over repeated runs.
MEDIAN_KEYS = (
    *(key for _, key, _ in FIGURES), "connected_s", "coordinator_cpu_enrol_s",
    "broker_cpu_enrol_s", "loadgen_cpu_rounds_s", "broker_rss_mb",
)  # fmt: skip


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for several runs of a scenario at one N: each figure's median (over the
    runs that have it), the rest from the first run; ``runs`` keeps every run's figures
    and enrolment phases (`loadgen_fleet.enrol_phases`)."""
    if not runs:
        raise ValueError("median_row needs one run at least")
    row = dict(runs[0])
    for key in dict.fromkeys(MEDIAN_KEYS):
        seen = [r[key] for r in runs if r.get(key) is not None]
        row[key] = round(float(np.median(seen)), 3) if seen else None
    row["runs"] = [{**{k: r.get(k) for k in dict.fromkeys(MEDIAN_KEYS)},
                    "enrol_phases": r.get("loadgen", {}).get("enrol_phases", {})}
                   for r in runs]  # fmt: skip
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one line per scenario and N."""
    head = ["scenario", "agents", "rounds", *(c for c, _, _ in FIGURES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["mode"], str(row["agents"]), str(row["rounds"])]
        cells += [f"{value(row, key, per):.3g}" for _, key, per in FIGURES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fits(rows: list[dict[str, Any]], at: float = 10_000) -> dict[str, dict[str, Any]]:
    """Per scenario and figure: the fits, the N^2 share at the largest N, and `at`."""
    out: dict[str, dict[str, Any]] = {}
    for mode in sorted({r["mode"] for r in rows}):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["agents"])
        ns = [r["agents"] for r in mine]
        for column, key, per in FIGURES:
            f = fit(ns, [value(r, key, per) for r in mine])
            out.setdefault(mode, {})[column] = {
                "per_agent": round(f.b, 6), "quadratic_c": f.qc,
                "n2_share_at_max": round(f.quadratic_share(max(ns)), 3),
                f"linear_at_{int(at)}": round(f.linear(at), 3),
                f"quadratic_at_{int(at)}": round(f.quadratic(at), 3),
            }  # fmt: skip
    return out


def fit_table(found: dict[str, dict[str, Any]], at: float = 10_000) -> str:
    head = ["scenario", "figure", "per agent", "N^2 share at max N",
            f"linear at {int(at):,}", f"quadratic at {int(at):,}"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, figures in found.items():
        for column, f in figures.items():
            lin, quad = f[f"linear_at_{int(at)}"], f[f"quadratic_at_{int(at)}"]
            lines.append(f"| {mode} | {column} | {f['per_agent']:.3g} | "
                         f"{f['n2_share_at_max']:.2f} | {lin:.3g} | {quad:.3g} |")  # fmt: skip
    return "\n".join(lines)

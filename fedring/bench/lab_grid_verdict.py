"""Issue 29's verdict on a grid: `auto` choosing codec and collective against the rest.

For every cell where ``auto-codec`` (``compression = "auto"``, ``collective = "auto"``)
ran, from the runs in ``grid.json`` and each fedring run's ``metrics.jsonl``:

- ``÷ best fixed``: its seconds to target over the best fixed fedring setting's (ring,
  fanout or hub at group-top-k, or the dense ring); the bar is 1.05;
- ``÷ fastest peer``: over the fastest peer's (dense ring, Flower FedAvg, DDP, DDP +
  PowerSGD); the bar is 1.0 within noise;
- ``dense comm``: the dense ring's share of its round spent communicating, from its
  rows (``comm_s / step_s``), else ``1 - compute / round`` with the compute of
  auto-codec's rows (the same model, batch and machine); where it is >= 0.8 the bar is
  5x every peer;
- ``compute floor``: the fewest rounds to target of any fedring run in the cell (the
  first row with ``accuracy >= target``) times the median ``compute_s`` of auto-codec's
  rows: the seconds to target were communication free. ``5x reachable`` says whether
  the fastest peer's time (a capped peer's counted as the cap) over 5 is at least that
  floor, i.e. whether any codec and collective could meet the 5x bar in that many
  rounds (in brackets: that time / 5 / the floor, the room left); "–" where the data
  cannot tell (no floor for want of rows or ``compute_s``; every peer capped; a run's
  rounds unknown), "n/a" where the bar does not apply. A run that kept no rows counts
  its ``rounds`` if it reached the target: the job stops at its ``target_accuracy``,
  so its last round is the first at the target. The floor leaves out every per-round
  cost but compute (latency too), so "no" is a strict verdict and "yes" only says that
  compute does not forbid the bar.

A cell is **held** where every bar that applies holds; where the others hold and the
5x bar fails only against peers that were capped (each over the cap, so its true
ratio is above the bound shown), it reads "cannot tell", not "not held".

**Noise** is measured in the grid itself: where ``auto`` or ``auto-codec`` ran the very
plan of a fixed method all through (the same collective and codec, no re-plan), the two
runs differ only by chance, so ``|their time ratio - 1|`` is a sample of the run-to-run
noise; the verdict states how many pairs, their median and their largest, and reads
"within noise" as at most ``1 + median`` (the strict reading: half the pairs of one
plan differed by more).

**Without the run folders.** What the verdict reads of a run's rows (`facts`) is kept
in its record in ``grid.json`` (``rows_digest``) each time the grid is written, so a
``grid.json`` moved or checked out without its run folders keeps its verdict. Cells
whose runs predate the digest carry the two figures their report had shown
(``recovered``: the dense comm share and the floor), used only while no run of the
cell has rows or a digest.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from fedring.bench.lab_grid_report import cells

Rows = Callable[[dict[str, Any]], list[dict[str, Any]]]  # a fedring run's metrics rows

FIXED = ("ring", "fanout", "hub", "dense")  # fedring's fixed settings ("dense": the dense ring)
PEERS = ("dense", "flower", "ddp", "powersgd2", "powersgd4")
COMM_BOUND = 0.8  # the dense round's communication share from which 5x is the bar
FEDRING_RUNS = (*FIXED, "auto", "auto-codec")  # the runs whose rounds set the compute floor
SAME_PLAN = {"ring": "ring", "fanout": "fanout", "hub": "hub", "dense ring": "dense"}


def _seconds(run: dict[str, Any] | None) -> float | None:
    return None if run is None else run.get("seconds_to_target")


def _ran(run: dict[str, Any] | None) -> bool:
    """A run that measured something (a capped run did; an error with no curve did not)."""
    return run is not None and not (run.get("error") and not run.get("curve"))


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows[2:] if isinstance(r.get(key), int | float)]
    return statistics.median(values) if values else None


def facts(run: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the verdict reads of a fedring run's rows: the medians past the warm-up of
    ``comm_s``, ``step_s`` and ``compute_s``, and the round it reached its target."""
    medians = {k: _median(rows, k) for k in ("comm_s", "step_s", "compute_s")}
    return {**medians, "at_target": rounds_to_target(run, rows)}


def _facts(rows_of: Rows, run: dict[str, Any]) -> dict[str, Any]:
    """`facts` from the run's rows; without them, from its record's ``rows_digest``."""
    rows = rows_of(run)
    kept = run.get("rows_digest")
    return kept if not rows and isinstance(kept, dict) else facts(run, rows)


def comm_share(rows_of: Rows, runs: dict[str, dict[str, Any]]) -> float | None:
    """The dense ring's communication share of its round (module docstring)."""
    dense = runs.get("dense")
    if dense is None:
        return None
    read = _facts(rows_of, dense)
    comm, step = read.get("comm_s"), read.get("step_s")
    if comm is not None and step:
        return min(1.0, comm / step)
    mine = runs.get("auto-codec")
    compute = _facts(rows_of, mine).get("compute_s") if mine is not None else None
    if compute is None or not dense.get("round_ms"):
        return None
    return max(0.0, 1.0 - compute * 1e3 / float(dense["round_ms"]))


def rounds_to_target(run: dict[str, Any], rows: list[dict[str, Any]]) -> int | None:
    """The first round whose row's accuracy reached `run`'s target; where the run kept no
    rows, its ``rounds`` if its curve ends at the target (module docstring); else None."""
    target = run.get("target")
    if not isinstance(target, int | float):
        return None
    if rows:
        return next((int(r["round"]) for r in rows if isinstance(r.get("round"), int)
                     and isinstance(r.get("accuracy"), int | float)
                     and r["accuracy"] >= target), None)  # fmt: skip
    curve = run.get("curve") or []
    ended_at_target = bool(curve) and float(curve[-1][1]) >= target
    return int(run["rounds"]) if _seconds(run) and ended_at_target and run.get("rounds") else None


def compute_floor(rows_of: Rows, runs: dict[str, dict[str, Any]]) -> tuple[int, float, bool] | None:
    """(fewest rounds to target, the compute floor in seconds, whether every fedring run
    that reached the target told its rounds); None without auto-codec's ``compute_s``
    or without a run's rounds to target (module docstring)."""
    mine = runs.get("auto-codec")
    per_round = _facts(rows_of, mine).get("compute_s") if mine is not None else None
    counts = {m: _facts(rows_of, runs[m]).get("at_target") for m in FEDRING_RUNS if m in runs}
    known = [n for n in counts.values() if n is not None]
    if per_round is None or not known:
        return None
    told = all(n is not None for m, n in counts.items() if _seconds(runs[m]))
    return min(known), min(known) * per_round, told


def reachable(floor: tuple[int, float, bool] | None, peers: dict[str, float | None],
              cap: float) -> str:  # fmt: skip
    """Whether the fastest peer's time / 5 >= the floor: "yes (room)", "no (room)" with
    room = that time / 5 / the floor, or "– (why)" where the data cannot tell."""
    if floor is None or not peers or floor[1] <= 0.0:
        return "– (no floor)"
    fastest = min((p or cap) for p in peers.values())
    exact = any(p and p <= fastest for p in peers.values())  # else every peer was capped
    room = f"{'' if exact else '≥ '}{fastest / 5.0 / floor[1]:.1f}"
    if fastest / 5.0 >= floor[1]:
        return f"yes ({room})"  # a capped peer's true time is above the cap: still reachable
    if not exact:
        return f"– (peers capped at {cap:g} s)"
    return f"no ({room})" if floor[2] else "– (a run's rounds unknown)"


def noise(doc: dict[str, Any]) -> list[float]:
    """|time ratio - 1| of every auto run that ran a fixed method's plan all through."""
    out = []
    for _, runs in cells(doc):
        for auto in ("auto", "auto-codec"):
            run = runs.get(auto)
            same = SAME_PLAN.get(str(run.get("collective"))) if run else None
            if auto == "auto" and run and run.get("collective") in FIXED[:3]:
                same = run["collective"]  # collective-only auto runs group-top-k
            a, b = _seconds(run), _seconds(runs.get(same or ""))
            if a and b:
                out.append(abs(a / b - 1.0))
    return out


def _ratio(mine: float | None, other: float | None, cap: float) -> tuple[str, float | None]:
    """mine / other as text and number; a bound where one side was capped."""
    if mine and other:
        return f"{mine / other:.2f}", mine / other
    if mine and other is None:
        return f"< {mine / cap:.2f}", mine / cap
    if other and mine is None:
        return f"> {cap / other:.2f}", None
    return "–", None


def cell_name(key: tuple[int, float, float, str]) -> str:
    """A cell's key in ``grid.json``'s ``recovered``: "N|Mbit/s|delay ms|model"."""
    n, bw, delay, model = key
    return f"{n}|{bw:g}|{delay:g}|{model}"


def _recovered(doc: dict[str, Any], key: tuple[int, float, float, str],
               runs: dict[str, dict[str, Any]], rows_of: Rows,
               ) -> tuple[float | None, tuple[int, float, bool] | None] | None:  # fmt: skip
    """The cell's dense comm share and floor as its report had them, while no run of the
    cell has rows or a digest (module docstring); else None."""
    saved = doc.get("recovered", {}).get(cell_name(key))
    if not isinstance(saved, dict) or any(
        rows_of(r) or r.get("rows_digest") for m, r in runs.items() if m in FEDRING_RUNS
    ):
        return None
    f = saved.get("floor")
    return saved.get("dense_comm"), (int(f[0]), float(f[1]), bool(f[2])) if f else None


def verdict(doc: dict[str, Any], rows_of: Rows) -> str:
    """The Markdown table and the noise line (module docstring)."""
    spread = noise(doc)
    tol = statistics.median(spread) if spread else 0.0
    lines = [
        "| N | model | Mbit/s | delay ms | auto (codec too) s | chose | ÷ best fixed | "
        "÷ fastest peer | dense comm | least × over a peer | compute floor s | "
        "5x reachable (room) | verdict |",
        "|" + "---|" * 13,
    ]
    held = total = capped = 0
    bar: dict[str, int] = {}  # "5x reachable" over the cells where the 5x bar applies
    for (n, bw, delay, model), runs in cells(doc):
        mine = runs.get("auto-codec")
        if mine is None:
            continue
        total += 1
        cap = float(mine["cap_s"])
        t = _seconds(mine)
        fixed = {m: _seconds(runs[m]) for m in FIXED if _ran(runs.get(m))}
        peers = {m: _seconds(runs[m]) for m in PEERS if _ran(runs.get(m))}
        best_f = min((v for v in fixed.values() if v), default=None)
        best_p = min((v for v in peers.values() if v), default=None)
        name_f = next((m for m, v in fixed.items() if v == best_f), "")
        name_p = next((m for m, v in peers.items() if v == best_p), "")
        text_f, r_f = _ratio(t, best_f, cap)
        text_p, r_p = _ratio(t, best_p, cap)
        share, floor = comm_share(rows_of, runs), compute_floor(rows_of, runs)
        if (saved := _recovered(doc, (n, bw, delay, model), runs, rows_of)) is not None:
            share, floor = saved
        worst = min(((p or cap) / t for p in peers.values()), default=None) if t else None
        exact = min((p / t for p in peers.values() if p), default=None) if t else None
        ok = t is not None and (r_f is None or r_f <= 1.05) and (r_p is None or r_p <= 1 + tol)
        # under 5x only against peers capped (their true time is past the cap): unknown
        unsure = False
        if share is not None and share >= COMM_BOUND:
            five = worst is not None and worst >= 5.0
            unsure = ok and not five and (exact is None or exact >= 5.0)
            ok = ok and five
        # nothing to compare (no other method ran, or none reached the target): no verdict
        reached = t is not None or best_f is not None or best_p is not None
        judged = bool(fixed) and bool(peers) and _ran(mine) and reached
        held += ok and judged
        capped += unsure and judged
        total -= not judged
        applies = judged and share is not None and share >= COMM_BOUND
        can = reachable(floor, peers, cap) if applies else "n/a"
        bar[can[0]] = bar.get(can[0], 0) + applies
        lines.append("| " + " | ".join([
            str(n), model, f"{bw:g}", f"{delay:g}",
            f"{t:.1f}" if t else f"> {cap:g} ({mine['best_accuracy']:.3f})",
            str(mine.get("collective") or "–"),
            f"{text_f} ({name_f})" if name_f else text_f,
            f"{text_p} ({name_p})" if name_p else text_p,
            "–" if share is None else f"{share:.2f}",
            "–" if worst is None else f"{'≥ ' if None in peers.values() else ''}{worst:.1f}",
            "–" if floor is None else f"{'' if floor[2] else '≤ '}{floor[1]:.3f} "
            f"({floor[0]} × {floor[1] / floor[0] * 1e3:.2f} ms)",
            can,
            ("not judged" if reached else "none reached") if not judged
            else "held" if ok else f"cannot tell (peers capped at {cap:g} s)" if unsure
            else "not held",
        ]) + " |")  # fmt: skip
    lines += ["", ""]  # a blank line ends the table
    if spread:
        lines[-1] = (f"Noise: {len(spread)} pairs of runs of the same plan; |ratio - 1| "
                     f"median {tol:.2f} (the tolerance of ÷ fastest peer), largest "
                     f"{max(spread):.2f}. ")  # fmt: skip
    lines[-1] += f"Held in {held} of {total} cells judged"
    lines[-1] += (f"; in {capped} more, every other bar held and only peers capped at the cap "
                  "stand under 5x, so the data cannot tell. " if capped else ". ")  # fmt: skip
    lines[-1] += (f"The 5x bar is unreachable at the compute floor in {bar.get('n', 0)} of the "
                  f"{sum(bar.values())} cells where it applies (reachable in "
                  f"{bar.get('y', 0)}; the data cannot tell in {bar.get('–', 0)}).")  # fmt: skip
    return "\n".join(lines)

"""`fedring bench grid --resume DIR`: a grid finished across several invocations.

The full grid (4 models x 3 bandwidths x 2 delays x N = 4 and 8, every method) takes
longer than one sitting on a small machine. Each run (one method in one cell) is kept
in ``DIR/grid.json`` the moment it ends, so an invocation cut short loses only the run
in progress. ``--resume`` reads that document back and runs only what it lacks: the
(cell, method) pairs with no run, or whose run failed before it measured anything
(an error and no curve), which it replaces. The grid's axes and methods become the
union of the stored ones and this invocation's, and the table and plot are re-made
from every run. A stored grid of another cap or seed is refused: its times would not
compare.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

RunKey = tuple[int, float, float, str, str]  # agents, Mbit/s, delay ms, model, method


class ResumeError(ValueError):
    """``--resume DIR`` cannot go on with the grid stored there (the message says why)."""


def run_key(run: Mapping[str, Any]) -> RunKey:
    return (int(run["agents"]), float(run["bandwidth_mbps"]), float(run["delay_ms"]),
            str(run["model"]), str(run["method"]))  # fmt: skip


def failed(run: Mapping[str, Any]) -> bool:
    """A run that measured nothing: resuming runs it again."""
    return bool(run.get("error")) and not run.get("curve")


def done(doc: Mapping[str, Any]) -> set[RunKey]:
    return {run_key(r) for r in doc["runs"] if not failed(r)}


def _union(old: Iterable[Any], new: Iterable[Any]) -> list[Any]:
    out = list(old)
    out += [v for v in new if v not in out]
    return out


def stored(out: Path, cap_s: float | None, seed: int | None) -> dict[str, Any] | None:
    """The grid document in `out` (None where there is none yet), refused where it
    cannot be read back or was run with another cap or seed (None: any)."""
    path = out / "grid.json"
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
            raise TypeError("no list of runs")
        for r in doc["runs"]:
            run_key(r)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"--resume {str(out)!r}: grid.json cannot be read back: {exc}") from None
    for name, value in (("cap_s", cap_s), ("seed", seed)):
        if value is not None and doc.get(name) != value:
            raise ResumeError(f"--resume {str(out)!r}: the stored grid has {name}="
                              f"{doc.get(name)!r}, this invocation {value!r}: their times "
                              "would not compare; use another directory")  # fmt: skip
    return doc


def resumed(out: Path, fresh: dict[str, Any]) -> dict[str, Any]:
    """The document stored in `out` grown by `fresh`'s axes and methods, or `fresh`
    itself where `out` holds none yet."""
    old = stored(out, fresh["cap_s"], fresh["seed"])
    if old is None:
        return fresh
    doc = {**fresh, "runs": old["runs"], "bench_seconds": float(old.get("bench_seconds", 0.0))}
    for axis in ("models", "bandwidths_mbps", "delays_ms", "agents", "methods"):
        doc[axis] = _union(old.get(axis, []), fresh[axis])
    doc["invocations"] = int(old.get("invocations", 1)) + 1
    if "recovered" in old:  # the figures of cells run before the digests (lab_grid_verdict)
        doc["recovered"] = old["recovered"]
    return doc


def record(doc: dict[str, Any], run: dict[str, Any]) -> None:
    """Add `run` to `doc`, in place of a failed run of the same method and cell."""
    key = run_key(run)
    runs = doc["runs"]
    for i, old in enumerate(runs):
        if run_key(old) == key and failed(old):
            runs[i] = run
            return
    runs.append(run)

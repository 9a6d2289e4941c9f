"""Seed one resumable grid (``fedring bench grid --resume DIR``) from earlier grid documents.

The grid's sittings before ``--resume`` existed each wrote their own ``grid.json``
(``docs/lab/grid.json``, ``grid2.json``, ``grid3.json``: the same cap and seed). This
writes ``DIR/grid.json`` holding all their runs, each tagged with the document it
came from (``source``); where two hold the same (cell, method), the later one's run
is kept. Axes and methods are the union. ``--resume DIR`` then runs only the rest.

    python bench/grid_merge.py --out runs/grid-full docs/lab/grid.json \
        docs/lab/grid2.json docs/lab/grid3.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedring.bench.lab_grid_resume import run_key

AXES = ("models", "bandwidths_mbps", "delays_ms", "agents", "methods")


def merge(paths: list[Path]) -> dict[str, Any]:
    docs = [json.loads(p.read_text()) for p in paths]
    for name in ("cap_s", "seed"):
        values = {d[name] for d in docs}
        if len(values) > 1:
            raise SystemExit(
                f"the documents differ in {name}: {sorted(values)}; times would not compare"
            )
    runs: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path, doc in zip(paths, docs, strict=True):
        for run in doc["runs"]:
            runs[run_key(run)] = {**run, "source": run.get("source", path.name)}
    out: dict[str, Any] = {"cap_s": docs[0]["cap_s"], "budget_s": None, "seed": docs[0]["seed"]}
    for axis in AXES:
        out[axis] = [v for d in docs for v in d[axis]]
        out[axis] = sorted(set(out[axis]), key=out[axis].index)
    out["bench_seconds"] = sum(float(d.get("bench_seconds", 0.0)) for d in docs)
    out["invocations"] = len(docs)
    out["runs"] = list(runs.values())
    out["not_run"] = []
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "grid.json"
    if target.exists():
        raise SystemExit(f"{target} exists: merge into a new directory")
    doc = merge(args.docs)
    target.write_text(json.dumps(doc, indent=1))
    cells = {run_key(r)[:4] for r in doc["runs"]}
    print(f"{target}: {len(doc['runs'])} runs, {len(cells)} cells")


if __name__ == "__main__":
    main()

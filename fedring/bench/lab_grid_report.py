"""The grid's report: Markdown tables and a bar plot of time to target per cell.

Reads the ``grid.json`` document of `fedring.bench.lab_grid` (its ``runs``), so a
report can be re-made from a stored run without running anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedring.bench.lab_grid_cpu import CPU_BOUND
from fedring.bench.lab_grid_methods import COMPRESSED, LABELS, PEERS

CellKey = tuple[int, float, float, str]  # agents, Mbit/s, delay ms, model


def cells(doc: dict[str, Any]) -> Iterator[tuple[CellKey, dict[str, dict[str, Any]]]]:
    """Each cell (in run order) with its runs by method."""
    found: dict[CellKey, dict[str, dict[str, Any]]] = {}
    for r in doc["runs"]:
        key = (r["agents"], r["bandwidth_mbps"], r["delay_ms"], r["model"])
        found.setdefault(key, {})[r["method"]] = r
    yield from found.items()


def not_run(doc: dict[str, Any]) -> list[CellKey]:
    """The cells the last sitting's budget left out (``not_run``), then every cell of the
    grid's axes that holds no run at all (a grid finished in sittings whose axes were
    narrowed by hand: only its report, made with the whole axes, sees those), in run
    order (N, bandwidth, delay, model)."""
    have = {key for key, _ in cells(doc)}
    left: list[CellKey] = [(c["agents"], float(c["bandwidth_mbps"]), float(c["delay_ms"]),
                            f"{c['model']['dataset']}/{c['model']['model']}")
                           for c in doc.get("not_run", [])]  # fmt: skip
    axes = [(int(n), float(bw), float(d), str(m)) for n in doc.get("agents", [])
            for bw in doc.get("bandwidths_mbps", []) for d in doc.get("delays_ms", [])
            for m in doc.get("models", [])]  # fmt: skip
    return left + [k for k in axes if k not in have and k not in left]


def cpu_bound(run: dict[str, Any]) -> bool:
    """The agents kept `CPU_BOUND` of the cores busy: the CPU, not the link, set the pace."""
    share = run.get("agents_cpu_share")
    return isinstance(share, int | float) and share >= CPU_BOUND


def seconds(run: dict[str, Any]) -> str:
    if run["error"] and run["seconds_to_target"] is None and not run["curve"]:
        return "error"
    mark = ("" if run["delay_applied"] else "†") + ("‡" if cpu_bound(run) else "")
    if run["seconds_to_target"] is None:
        return f"> {run['cap_s']:g} ({run['best_accuracy']:.3f}){mark}"
    return f"{run['seconds_to_target']:.1f}{mark}"


def reference(runs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """fedring's run the speed-ups are over: auto where it ran, else the fastest fixed one."""
    if "auto" in runs:
        return runs["auto"]
    fixed = [runs[m] for m in COMPRESSED if m in runs and runs[m]["seconds_to_target"]]
    return min(fixed, key=lambda r: r["seconds_to_target"], default=None)


def speedup(mine: dict[str, Any] | None, peer: dict[str, Any]) -> str:
    """peer's time over fedring's: exact, a bound where a side was capped, '–' if unknown."""
    if mine is None or (peer["error"] and not peer["curve"]):
        return "–"
    mark = "" if peer["delay_applied"] else "†"
    t, p = mine["seconds_to_target"], peer["seconds_to_target"]
    if t and p:
        return f"{p / t:.1f}×{mark}"
    if t and p is None:
        return f"> {peer['cap_s'] / t:.1f}×{mark}"
    if p and t is None:
        return f"< {p / mine['cap_s']:.2f}×{mark}"
    return "–"


def auto_vs_best(runs: dict[str, dict[str, Any]]) -> str:
    auto = runs.get("auto")
    fixed = [runs[m]["seconds_to_target"] for m in ("ring", "fanout", "hub") if m in runs]
    best = min((t for t in fixed if t), default=None)
    if auto is None or not auto["seconds_to_target"] or best is None:
        return "–"
    return f"{auto['seconds_to_target'] / best:.2f}"


def pace_vs_best(runs: dict[str, dict[str, Any]]) -> str:
    """auto's median round over the fastest fixed collective's: whether it picked the
    fastest collective, without the convergence noise in time to target."""
    auto = runs.get("auto")
    fixed = [runs[m].get("round_ms") for m in ("ring", "fanout", "hub") if m in runs]
    best = min((t for t in fixed if t), default=None)
    if auto is None or not auto.get("round_ms") or best is None:
        return "–"
    return f"{auto['round_ms'] / best:.2f}"


def pace_vs_dense(runs: dict[str, dict[str, Any]]) -> str:
    """auto-codec's median round over the dense ring's (the codec choice's promise: <= 1)."""
    mine, dense = runs.get("auto-codec", {}).get("round_ms"), runs.get("dense", {}).get("round_ms")
    return f"{mine / dense:.2f}" if mine and dense else "–"


def paces(doc: dict[str, Any]) -> list[str]:
    """The table of fedring's median round, ms, per collective and cell."""
    mine = [m for m in COMPRESSED if m in doc["methods"]]
    if not any(r.get("round_ms") for r in doc["runs"]):
        return []
    mine += [m for m in ("dense",) if m in doc["methods"]]
    lines = ["", "Median ms from one round to the next (fedring's collectives; `auto`'s "
             "includes its tries; auto (codec too) ÷ dense ring: above 1, the codec choice "
             "lost to the dense ring on that link):", "",
             "| N | model | Mbit/s | delay ms | " + " | ".join(LABELS[m] for m in mine)
             + " | auto ÷ fastest fixed | auto (codec too) ÷ dense ring |",
             "|" + "---|" * (len(mine) + 6)]  # fmt: skip
    for (n, bw, delay, model), runs in cells(doc):
        row = [str(n), model, f"{bw:g}", f"{delay:g}"]
        row += [f"{runs[m]['round_ms']:.1f}" if runs.get(m, {}).get("round_ms") else "–"
                for m in mine]  # fmt: skip
        lines.append("| " + " | ".join([*row, pace_vs_best(runs), pace_vs_dense(runs)]) + " |")
    return lines


def chose(runs: dict[str, dict[str, Any]]) -> str:
    """What `auto` (and `auto-codec`) ran: "ring", "auto-codec: dense ring→ring"."""
    said = [(m, runs[m].get("collective") or "–") for m in ("auto", "auto-codec") if m in runs]
    if len(said) == 1 and said[0][0] == "auto":
        return said[0][1]
    return "; ".join(f"{m}: {c}" for m, c in said) or "–"


def cpu(runs: dict[str, dict[str, Any]]) -> str:
    """The cell's highest agents' CPU share and the machine's busy fraction in that run."""
    shares = [r for r in runs.values() if isinstance(r.get("agents_cpu_share"), int | float)]
    if not shares:
        return "–"
    top = max(shares, key=lambda r: r["agents_cpu_share"])
    busy = top.get("machine_cpu_busy")
    mark = " ‡" if cpu_bound(top) else ""
    return f"{top['agents_cpu_share']:.2f}{mark}" + (f" ({busy:.2f})" if busy is not None else "")


def tables(doc: dict[str, Any]) -> str:
    methods = [m for m in doc["methods"]]
    head = (
        "| N | model (params) | Mbit/s | delay ms | "
        + " | ".join(LABELS[m] for m in methods)
        + " | auto chose | auto ÷ best fixed | agents' CPU |"
    )
    bound = doc.get("cpu_bound_share", CPU_BOUND)
    lines = [f"Seconds of training to the target (cap {doc['cap_s']:g} s; > cap: not reached, "
             "best accuracy in brackets; † the added delay did not apply to this method; "
             f"‡ CPU-bound: the agents' processes kept >= {bound:.0%} of the machine's cores "
             "busy, so the CPU, not the link, set the pace; agents' CPU: the cell's highest "
             "share, the whole machine's busy fraction in brackets):",
             "", head, "|" + "---|" * (len(methods) + 7)]  # fmt: skip
    for (n, bw, delay, model), runs in cells(doc):
        params = next(iter(runs.values()))["params"]
        row = [str(n), f"{model} ({params:,})", f"{bw:g}", f"{delay:g}"]
        row += [seconds(runs[m]) if m in runs else "not run" for m in methods]
        row += [chose(runs), auto_vs_best(runs), cpu(runs)]
        lines.append("| " + " | ".join(row) + " |")
    peers = [m for m in PEERS if m in methods]
    lines += [] if not peers else [
              "", "Speed-up of fedring (auto where it ran, else the fastest fixed collective) "
              "over each peer: the peer's seconds over fedring's:", "",
              "| N | model | Mbit/s | delay ms | fedring | "
              + " | ".join(f"× {LABELS[m]}" for m in peers) + " |",
              "|" + "---|" * (len(peers) + 5)]  # fmt: skip
    for (n, bw, delay, model), runs in cells(doc) if peers else ():
        mine = reference(runs)
        name = "–" if mine is None else mine["method"]
        row = [str(n), model, f"{bw:g}", f"{delay:g}", name]
        row += [speedup(mine, runs[m]) if m in runs else "not run" for m in peers]
        lines.append("| " + " | ".join(row) + " |")
    lines += paces(doc)
    left = not_run(doc)
    if left:
        lines += ["", "Cells not run (the last sitting's time budget ran out before they started, "
                  "or no sitting has named them yet):", ""]  # fmt: skip
        lines += [f"- N={n}, {bw:g} Mbit/s, {delay:g} ms, {model}" for n, bw, delay, model in left]
    errors = [r for r in doc["runs"] if r["error"]]
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- {r['agents']} agents, {r['bandwidth_mbps']:g} Mbit/s, {r['delay_ms']:g} ms,"
                  f" {r['model']}, {r['method']}: {r['error']}" for r in errors]  # fmt: skip
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> Path:
    """Grouped bars: seconds to target per cell and method (log); capped runs hatched at the cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = list(cells(doc))
    methods = list(doc["methods"])
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(found) * len(methods) / 4), 5.0))
    colours = plt.get_cmap("tab10")
    for j, method in enumerate(methods):
        xs, ys, capped = [], [], []
        for i, (_, runs) in enumerate(found):
            run = runs.get(method)
            if run is None or (run["error"] and not run["curve"]):
                continue
            xs.append(i + (j - (len(methods) - 1) / 2) * width)
            ys.append(run["seconds_to_target"] or run["cap_s"])
            capped.append(run["seconds_to_target"] is None)
        bars = ax.bar(xs, ys, width, label=LABELS[method], color=colours(j % 10))
        for bar, cut in zip(bars, capped, strict=True):
            if cut:
                bar.set_hatch("//")
                bar.set_alpha(0.35)
    ax.axhline(doc["cap_s"], color="grey", linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(found)))
    ax.set_xticklabels([f"N={n} {model}\n{bw:g} Mbit/s, +{d:g} ms" for (n, bw, d, model), _
                        in found], fontsize=7)  # fmt: skip
    ax.set_ylabel("seconds of training to target (log; hatched: not reached by the cap)")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""``report.md``: a table of the runs' figures, then their plots, dense beside compressed.

`write_report` takes the per-round rows of one or more runs and the summaries
they ended with; `write_report_for` does it for one job (`fedring simulate`, the
MQTT coordinator), beside its dense fp32 baseline when one ran.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedring.config import JobSpec
from fedring.extras import MissingExtra, require
from fedring.report.files import atomic_write

if TYPE_CHECKING:
    from fedring.report.plots import Rows

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
    try:  # matplotlib: only when a report is drawn, and a lean install goes without
        require("matplotlib", "report.md's plots")
        from fedring.report.plots import plot_runs

        plots = plot_runs(out, runs)
    except MissingExtra as exc:
        plots, notes = {}, [*notes, f"no plots: {exc}"]
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
    atomic_write(report, "\n".join(lines))
    return {"report": str(report), **{k: str(v) for k, v in plots.items()}}


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def run_name(spec: JobSpec) -> str:
    if spec.compression == "none":
        return "dense fp32 ring"
    return f"group-topk {spec.density:.2%} ({spec.value_dtype})"


def write_report_for(
    out: Path,
    spec: JobSpec,
    summary: dict[str, Any],
    baseline: dict[str, Any] | None = None,
    *,
    command: str = "fedring simulate",
) -> dict[str, str]:
    """`report.md` and plots for one job's run, beside its dense baseline when one ran."""
    name = run_name(spec)
    runs = {name: summary["rows"]}
    summaries = {name: summary}
    if baseline is not None:
        runs["dense fp32 ring"] = baseline["rows"]
        summaries["dense fp32 ring"] = baseline
    notes = [f"{spec.agents} agents, dataset {spec.dataset}, model {spec.model}, sync {spec.sync},"
             f" layout {summary.get('layout', '?')}, seed {spec.seed}"]  # fmt: skip
    onnx = summary.get("onnx") or {}
    if "path" in onnx:
        notes.append(
            f"ONNX: {Path(onnx['path']).name}, {onnx['bytes']:,} bytes, opset {onnx['opset']}, "
            f"max |onnxruntime - torch| {onnx['max_abs_diff']:.1e} on {onnx['inputs_checked']} "
            f"inputs, test accuracy {onnx.get('accuracy_onnx', float('nan')):.4f}"
        )
    elif "error" in onnx:
        notes.append(f"ONNX export FAILED its checks: {onnx['error']}")
    title = f"{command}: {name}" + (" beside a dense fp32 ring" if baseline else "")
    return write_report(out, runs, title=title, summaries=summaries, notes=notes)

"""What `--out DIR` writes: metrics.jsonl (one row per round), config.toml, summary.json."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedring.config import JobSpec


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a file


def jsonl(rows: Sequence[Mapping[str, Any]]) -> str:
    """One JSON object per line (metrics.jsonl)."""
    return "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)


def write_outputs(out: Path, spec: JobSpec, summary: dict[str, Any]) -> dict[str, str]:
    """Write the run's files under `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "metrics": out / "metrics.jsonl",
        "config": out / "config.toml",
        "summary": out / "summary.json",
    }
    atomic_write(paths["metrics"], jsonl(summary["rows"]))
    config = "".join(f"{k} = {_toml_value(v)}\n" for k, v in spec.resolved().items())
    atomic_write(
        paths["config"], "# resolved job: `fedring simulate --config` reads it back\n" + config
    )
    brief = {k: v for k, v in summary.items() if k != "rows"}
    atomic_write(paths["summary"], json.dumps(brief, indent=2, sort_keys=True) + "\n")
    return {k: str(v) for k, v in paths.items()}


BASELINE_KEYS = (
    "final_accuracy", "rounds", "bytes_sent_per_agent", "wall_seconds", "sim_seconds",
    "sim_seconds_to_target", "sim_rounds_to_target", "fleet",
)  # fmt: skip


def dense_twin(spec: JobSpec) -> JobSpec:
    """The same job as a dense fp32 ring. A learning rate that was the automatic choice
    for group-top-k (0.1, plain EF-SGD) becomes the dense ring's automatic one (0.025)."""
    auto = spec.replace(lr=0.0).lr == spec.lr
    return spec.replace(compression="none", lr=0.0 if auto else spec.lr)


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
    """`report.md` and plots for a simulate run, beside its dense baseline when one ran."""
    from fedring.coordinator.report import write_report

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

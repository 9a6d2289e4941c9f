"""`fedring export onnx CHECKPOINT --out FILE [--int8]`: what to deploy after a run.

    fedring export onnx runs/d1/checkpoint.pt --out runs/d1/model.onnx --int8

CHECKPOINT is a coordinator checkpoint (a ``checkpoint.pt`` or the folder holding
one), read with ``torch.load(weights_only=True)``. The job's spec inside it names
the model and the dataset; the dataset is loaded to learn the input shape and to
report test accuracy of the export. Exit codes: 0 done, 1 the export failed its
checks, 2 bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

export_app = typer.Typer(
    rich_markup_mode="markdown",  # not "rich": NAME[/LINK] and [defaults] stay literal
    help="Export a trained model for deployment.",
    no_args_is_help=True,
)


def _checkpoint_dir(path: Path) -> Path:
    from fedring.coordinator.checkpoint import FILE

    if path.is_dir():
        return path
    if path.name != FILE:
        raise typer.BadParameter(
            f"{path}: expected a {FILE} written by the coordinator, or its folder",
            param_hint="CHECKPOINT",
        )
    return path.parent


@export_app.command("onnx")
def export_onnx_cmd(
    checkpoint: Path = typer.Argument(..., help="checkpoint.pt (or its folder) from a run."),
    out: Path = typer.Option(..., "--out", help="The .onnx file to write."),
    int8: bool = typer.Option(False, "--int8", help="Also write <stem>.int8.onnx (dynamic)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
) -> None:
    """Export to ONNX, run onnx.checker (full) and compare ONNX Runtime with torch."""
    from fedring.coordinator.checkpoint import CheckpointError
    from fedring.coordinator.onnx_export import ExportError, export_from_checkpoint

    try:
        report = export_from_checkpoint(_checkpoint_dir(checkpoint), out, int8=int8)
    except (CheckpointError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)  # unwrapped: the field stays greppable
        raise typer.Exit(2) from None
    except ExportError as exc:
        typer.echo(f"export failed: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(report, sort_keys=True))
        return
    typer.echo(summary_line(report))


def summary_line(r: dict[str, Any]) -> str:
    """One readable line: file, size, parity, accuracy, and the int8 copy when made."""
    text = (
        f"{r['path']}: {r['bytes']:,} bytes, opset {r['opset']}, checker ok, "
        f"max |onnxruntime - torch| = {r['max_abs_diff']:.2e} on {r['inputs_checked']} inputs"
    )
    if "accuracy_onnx" in r:
        text += f", test accuracy {r['accuracy_onnx']:.4f} (torch {r['accuracy_torch']:.4f})"
    if "int8" in r:
        q = r["int8"]
        text += f"\nint8: {q['path']}: {q['bytes']:,} bytes"
        if "accuracy" in q:
            text += f", test accuracy {q['accuracy']:.4f}"
    return text


def export_after_run(out: Path, seed: int, into: dict[str, Any]) -> Any:
    """An `on_done` hook for `simulate`: export the trained model to ``out/model.onnx``.

    The report (or the error, when the export fails its checks) lands in `into`;
    the run's other outputs are written either way.
    """

    def hook(model: Any, dataset: Any) -> None:
        from fedring.coordinator.onnx_export import ExportError, export_onnx

        test = (dataset.x_test.numpy(), dataset.y_test.numpy())
        try:
            into.update(
                export_onnx(model, dataset.feature_shape, out / "model.onnx", seed=seed,
                            test_set=test)
            )  # fmt: skip
        except ExportError as exc:
            into["error"] = str(exc)

    return hook

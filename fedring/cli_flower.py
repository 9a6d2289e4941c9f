"""`fedring flower ...`: fedring jobs on Flower's simulation engine.

    fedring flower simulate --clients 8 --dataset digits --rounds 20 --json

Flags are those of `fedring simulate` (a TOML job file works too), plus
`--clients` (the number of simulated SuperNodes), `--downlink`, `--round-timeout`,
`--enrol-timeout` (the nodes' start and enrolment), `--timeout` (the whole run) and
`--cpus` (what Ray may use; each client takes one). Flower and Ray
are imported only when a command runs, so the rest of the CLI works without them.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

flower_app = typer.Typer(
    rich_markup_mode="markdown",  # not "rich": NAME[/LINK] and [defaults] stay literal
    help="Run fedring jobs on Flower (simulation engine; see docs/flower.md for deployment).",
    no_args_is_help=True,
)
err = Console(stderr=True)

# Over Flower the default job is a compressed star running local SGD (FedAvg-like
# rounds with group-top-k uplinks); flags and the job file override these.
FLOWER_DEFAULTS: dict[str, Any] = {
    "topology": "star", "sync": "local", "local_steps": 12, "lr": 0.05, "rounds": 20,
    "eval_every": 5,
}  # fmt: skip


@flower_app.command("simulate")
def simulate_cmd(
    config: Path | None = typer.Option(None, "--config", help="TOML job file; flags override it."),
    clients: int | None = typer.Option(None, help="Simulated SuperNodes (= agents). [4]"),
    dataset: str | None = typer.Option(
        None, help="digits | mnist1d | synthetic[:N:D:C] | npz:PATH."
    ),
    model: str | None = typer.Option(None, help="mlp | cnn | MODULE:FACTORY. [mlp]"),
    sharding: str | None = typer.Option(None, help="iid | dirichlet:ALPHA | quantity:BETA. [iid]"),
    compression: str | None = typer.Option(None, help="none | group-topk (uplink). [group-topk]"),
    density: float | None = typer.Option(None, help="Fraction kept per group. [0.01]"),
    group_size: int | None = typer.Option(None, help="G, entries per group. [256]"),
    value_dtype: str | None = typer.Option(None, help="fp32 | fp16 | bf16 | int8. [fp16]"),
    error_feedback: bool | None = typer.Option(
        None, "--error-feedback/--no-error-feedback", help="[on]"
    ),
    topology: str | None = typer.Option(
        None, help="star | ring (relayed by the ServerApp). [star]"
    ),
    sync: str | None = typer.Option(
        None, help="local (H local steps, compressed delta) | sync (one gradient). [local]"
    ),
    local_steps: int | None = typer.Option(None, help="H, local steps per round. [12]"),
    aggregation: str | None = typer.Option(
        None, help="mean | weighted | vote | median | trimmed:B. [mean]"
    ),
    sample: float | None = typer.Option(
        None, help="Clients trained per round (star): a fraction in (0, 1], or a number "
        ">= 2; seeded, the same every run. [1.0: all]",
    ),
    sit_out: str | None = typer.Option(
        None, help="Error-feedback residual of a client back from sitting out: keep | reset "
        "| decay:G (x G per round missed). [keep]",
    ),
    rounds: int | None = typer.Option(None, help="Communication rounds. [20]"),
    batch_size: int | None = typer.Option(None, help="Per-client batch size. [32]"),
    lr: float | None = typer.Option(None, help="Learning rate of the local steps. [0.05]"),
    lr_scaling: str | None = typer.Option(None, help="linear | sqrt | none (sync mode). [linear]"),
    warmup_steps: int | None = typer.Option(None, help="Gradual warm-up steps (sync). [50]"),
    momentum: float | None = typer.Option(None, help="SGD momentum of local steps. [0.9]"),
    eval_every: int | None = typer.Option(None, help="Rounds between evaluations. [5]"),
    seed: int | None = typer.Option(None, help="Seed of split, shards, init and batches. [0]"),
    downlink: str = typer.Option("dense", help="dense (fp32 delta) | group-topk (with EF)."),
    server_momentum: float = typer.Option(
        0.5, help="local mode: FedAvgM momentum of the ServerApp."
    ),
    round_timeout: float = typer.Option(120.0, help="Seconds the ServerApp waits for a round."),
    enrol_timeout: float = typer.Option(
        300.0, help="Seconds the ServerApp waits for the nodes and their enrolment."
    ),
    timeout: float = typer.Option(
        900.0, min=1.0, help="Seconds for the whole run; then it is stopped."
    ),
    cpus: int | None = typer.Option(None, min=1, help="CPUs Ray may use. [all]"),
    out: Path | None = typer.Option(None, "--out", help="Write summary.json and flower.log here."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary object on stdout."),
) -> None:
    """Train on Flower's simulation engine: ClientApps on Ray, fedring's ServerApp."""
    given = {k: v for k, v in locals().items() if v is not None}  # before any other local
    skip = ("config", "out", "as_json", "downlink", "server_momentum", "round_timeout",
            "enrol_timeout", "timeout", "cpus", "clients")  # fmt: skip
    flags = {k: v for k, v in given.items() if k not in skip}
    if clients is not None:
        flags["agents"] = clients
    from fedring.config import JobSpec
    from fedring.flower.job import FlowerJob
    from fedring.flower.simulation import SimulationError, simulate

    try:
        base = {**FLOWER_DEFAULTS, **flags}
        spec = JobSpec.from_toml(config, base) if config else JobSpec.from_mapping(base)
        job = FlowerJob(spec, downlink, round_timeout, server_momentum, enrol_timeout)
    except ValueError as exc:
        err.print(f"[red]error: {escape(str(exc))}[/red]")
        raise typer.Exit(2) from None
    with tempfile.TemporaryDirectory(prefix="fedring-flower-") as tmp:
        try:
            summary = simulate(job, out or Path(tmp), timeout_s=timeout, cpus=cpus)
        except SimulationError as exc:
            if as_json:  # still one JSON object, as promised
                typer.echo(json.dumps({"status": f"failed: {exc}", "clients": spec.agents}))
            err.print(f"[red]run failed: {escape(str(exc))}[/red]")
            raise typer.Exit(1) from None
    brief = {k: v for k, v in summary.items() if k != "rows"}
    if as_json:
        typer.echo(json.dumps(brief, sort_keys=True))
    else:
        Console().print(_table(spec.agents, brief))
    if summary.get("status") != "completed":
        raise typer.Exit(1)


def _table(clients: int, r: dict[str, Any]) -> Table:
    table = Table(title=f"flower simulate: {clients} clients, {r['layout']}")
    table.add_column("", justify="right")
    table.add_column("value", justify="right")
    table.add_row("status", str(r["status"]))
    table.add_row("final accuracy", f"{r['final_accuracy']:.4f}")
    table.add_row("rounds", str(r["rounds"]))
    table.add_row("uplink bytes per client", f"{r['uplink_bytes_per_client']:,.0f}")
    table.add_row("downlink bytes per client", f"{r['downlink_bytes_per_client']:,.0f}")
    table.add_row(
        "dense fp32 uplink would be", f"{r['dense_equivalent_uplink_bytes_per_client']:,.0f}"
    )
    table.add_row("failures", str(len(r["failures"])))
    table.add_row("wall seconds", f"{r['wall_seconds']:.1f}")
    return table

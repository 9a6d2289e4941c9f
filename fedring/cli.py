"""The `fedring` command.

    fedring bench compress --numel 10000000 --density 0.01 --json
    fedring bench ring --agents 8 --numel 1000000 --density 0.01

Exit codes: 0 done, 1 failed run, 2 bad input (the message names the option).
Long work shows progress on a terminal and stays quiet in pipes; `--json` prints
one JSON object on stdout at the end.

This module builds the command tree and its root options; the commands live by
group: `cli_simulate`, `cli_bench`, `cli_mqtt` (agent, coordinator, bench mqtt), `cli_fleet`,
`cli_flower`, `cli_lab` (lab, bench lab, bench grid), `cli_profile` and `cli_export`.
"""

from __future__ import annotations

import logging
import sys

import typer
from rich.console import Console
from rich.markup import escape

from fedring import (
    __version__,
    cli_bench,
    cli_export,
    cli_fleet,
    cli_mqtt,
    cli_profile,
    cli_simulate,
)
from fedring.cli_flower import flower_app
from fedring.cli_lab import bench_grid_cmd, bench_lab_cmd, lab_app
from fedring.extras import explain

app = typer.Typer(
    rich_markup_mode="markdown",  # not "rich": NAME[/LINK] and [defaults] stay literal
    help="Train one PyTorch model across edge boards: group-top-k + error feedback, "
    "exchanged in a ring over MQTT or Flower.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals can hold keys and whole datasets
)
bench_app = typer.Typer(
    rich_markup_mode="markdown",  # not "rich": NAME[/LINK] and [defaults] stay literal
    help="Benchmarks that print fedring beside its baselines, measured in the same run.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")
app.command("agent")(cli_mqtt.agent_cmd)
app.command("fleet")(cli_fleet.fleet_cmd)
app.command("simulate")(cli_simulate.simulate_cmd)
bench_app.command("mqtt")(cli_mqtt.bench_mqtt_cmd)
bench_app.command("lab")(bench_lab_cmd)
bench_app.command("grid")(bench_grid_cmd)
bench_app.command("compress")(cli_bench.bench_compress)
bench_app.command("ring")(cli_bench.bench_ring)
bench_app.command("quality")(cli_bench.bench_quality)
app.add_typer(cli_mqtt.coordinator_app, name="coordinator")
app.add_typer(cli_export.export_app, name="export")
app.add_typer(cli_profile.profile_app, name="profile")
app.add_typer(flower_app, name="flower")
app.add_typer(lab_app, name="lab")
err = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fedring {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log refused frames and retries."),
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main() -> None:
    try:
        app()
    except ValueError as exc:  # input our own checks refused
        err.print(f"[red]error: {escape(str(exc))}[/red]")
        sys.exit(2)
    except ImportError as exc:  # a lean install: say which extra the command needs
        why = explain(exc)
        if why is None:
            raise
        err.print(f"[red]error: {escape(why)}[/red]")
        sys.exit(2)

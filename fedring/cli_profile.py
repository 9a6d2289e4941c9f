"""`fedring profile list | show NAME | detect | check FILE`: the boards fedring knows.

    fedring profile list
    fedring profile show rpi4 --json
    fedring profile detect
    fedring profile check my-board.toml     # exit 2 naming the bad field

Exit codes: 0 done, 2 bad input (unknown profile, invalid file; the message names
the field).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

profile_app = typer.Typer(
    rich_markup_mode="markdown",  # not "rich": NAME[/LINK] and [defaults] stay literal
    help="Board profiles: list, show, detect, check.",
    no_args_is_help=True,
)


def _doc(p: Any) -> dict[str, Any]:
    doc = asdict(p)
    doc["links"] = {k: asdict(v) for k, v in p.links.items()}
    return doc


@profile_app.command("list")
def list_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Every shipped profile with its compute, memory budget and links."""
    from fedring.firmware_profiles.schema import builtin_profiles

    profiles = builtin_profiles()
    if as_json:
        typer.echo(json.dumps({n: _doc(p) for n, p in profiles.items()}, sort_keys=True))
        return
    table = Table(title="board profiles (* default link; `fedring profile show NAME`)",
                  box=box.SIMPLE_HEAD)  # no side rules: seven columns fit 80 characters
    for col in ("name", "aliases", "cores", "GFLOPS", "budget MB", "wifi Mb/s ms", "eth Mb/s ms"):
        if col == "name":  # the name a user types: never cut, whatever the width
            table.add_column(col, no_wrap=True, min_width=max(len(n) for n in profiles))
        elif col == "aliases":  # typed too: wrapped at spaces, never cut with "…"
            longest = max((len(a) for p in profiles.values() for a in p.aliases), default=1)
            table.add_column(col, overflow="fold", min_width=longest)
        else:
            table.add_column(col, justify="right")
    for p in profiles.values():
        cells = []
        for kind in ("wifi", "ethernet"):
            lk = p.links.get(kind)
            star = "*" if kind == p.default_link else ""
            cells.append(f"{star}{lk.bandwidth_mbps:g} {lk.latency_ms:g}" if lk else "-")
        table.add_row(p.name, " ".join(p.aliases), str(p.cores), f"{p.gflops:g}",
                      str(p.ram_budget_mb), *cells)  # fmt: skip
    Console().print(table)


@profile_app.command("show")
def show_cmd(
    name: str = typer.Argument(..., help="Profile name or alias, e.g. rpi4."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """One profile: every field, and the file with its sources."""
    from fedring.firmware_profiles.schema import ProfileError, load_builtin

    try:
        p = load_builtin(name)
    except ProfileError as exc:
        typer.echo(f"error: {exc}", err=True)  # unwrapped: the field stays greppable
        raise typer.Exit(2) from None
    doc = _doc(p)
    if as_json:
        typer.echo(json.dumps(doc, sort_keys=True))
        return
    for key, value in doc.items():
        typer.echo(f"{key:18} {value}")


@profile_app.command("detect")
def detect_cmd(
    model_file: Path = typer.Option(Path("/proc/device-tree/model"), help="Device-tree model."),
    tegra_file: Path = typer.Option(Path("/etc/nv_tegra_release"), help="L4T release file."),
    meminfo: Path = typer.Option(Path("/proc/meminfo"), help="For MemTotal."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The profile this board gets with `fedring agent --profile auto`, and why."""
    from fedring.firmware_profiles.detect import detect

    found = detect(model_file, tegra_file, meminfo)
    if as_json:
        typer.echo(json.dumps({"profile": found.profile.name, "reason": found.reason}))
    else:
        typer.echo(f"{found.profile.name}  ({found.reason})")


@profile_app.command("check")
def check_cmd(file: Path = typer.Argument(..., help="A profile TOML file.")) -> None:
    """Validate a profile file: exit 0 when usable, 2 naming the bad field."""
    from fedring.firmware_profiles.schema import ProfileError, load_profile

    try:
        p = load_profile(file)
    except ProfileError as exc:
        typer.echo(f"error: {exc}", err=True)  # unwrapped: the field stays greppable
        raise typer.Exit(2) from None
    typer.echo(f"{file}: ok ({p.name}, {p.description})")

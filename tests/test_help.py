"""Every command's --help renders, and shows bracketed text ([defaults], NAME[/LINK]) literally."""

from __future__ import annotations

import click
import pytest
import typer
from typer.testing import CliRunner

from fedring.cli import app


def _paths(cmd: click.Command, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            out += _paths(sub, (*prefix, name))
    return out


COMMANDS = _paths(typer.main.get_command(app))


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "fedring")
def test_help_renders(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_help_keeps_brackets() -> None:
    out = CliRunner(env={"COLUMNS": "240"}).invoke(app, ["simulate", "--help"]).output
    assert "NAME[/wifi|/ethernet][:COUNT]" in out
    assert "[digits]" in out
    assert len(COMMANDS) > 10  # the walk found the sub-commands

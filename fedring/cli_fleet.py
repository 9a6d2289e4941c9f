"""`fedring fleet`: the boards on a broker, their state, versions, memory and job.

    fedring fleet --broker mqtt://broker.lan:1883 --username operator \\
        --password-file /etc/fedring/operator.password
    fedring fleet --broker mqtt://127.0.0.1:1883 --json | jq '.boards[] | {id, state}'
    fedring fleet --broker mqtt://127.0.0.1:1883 --watch

It reads what agents publish about themselves (`fleet_watch.FleetReader`, read-only)
into a `fleet.BoardTable`, and draws it: a table, one JSON object, or, with ``--watch``,
a live table on a terminal (JSON lines with ``--json``; the table once, then one line per
change, in a pipe). Exit codes: 0 done (Ctrl-C ends a watch), 1 no broker, 2 bad input.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fedring.cli_mqtt import _CA, _CERT, _KEY, _PWFILE, BROKER_HELP, broker_config

err = Console(stderr=True)
TICK_S = 0.25  # how often a watch looks for a change of state
REDRAW_S = 1.0  # and redraws anyway
COLOURS = {"online": "green", "lost": "red", "offline": "dim", "unknown": "yellow"}


def fleet_cmd(
    broker: str = typer.Option(..., "--broker", "--url", help=BROKER_HELP),
    username: str | None = typer.Option(
        None,
        "--username",
        help="Broker user name: one of the operator's own, allowed to read "
        "fedring/v1/agents/# (it publishes nothing). Not an agent's or the coordinator's: "
        "a broker that binds client ids to user names would throw that process off.",
    ),
    password_file: Path | None = _PWFILE,
    ca: Path | None = _CA,
    cert: Path | None = _CERT,
    key: Path | None = _KEY,
    as_json: bool = typer.Option(
        False, "--json", help='Print one JSON object {"boards": [...], ...} on stdout.'
    ),
    watch: bool = typer.Option(
        False, "--watch", help="Redraw every second (and at once on a change) until Ctrl-C."
    ),
    timeout: float = typer.Option(
        10.0,
        "--timeout",
        min=0.5,
        max=600.0,
        help="Seconds a look listens at most before it prints (a watch: before its first "
        "drawing). It stops sooner, once every board online has beaten or stayed silent "
        "past 1.25x its keep-alive; a board still undecided shows as online with no beat "
        "age.",
    ),
) -> None:
    """List the boards on a broker: id, state, profile, architecture, fedring and torch
    versions, resident memory (RSS) and the board's total, the age of its latest
    heartbeat, its uptime and the job it is in.

    * **online**: its retained status says so, and it beats (3 times a keep-alive).
    * **lost**: the broker sent its last will (it died), or no beat came for 1.25x its
      keep-alive (a hung board, seen before the broker notices).
    * **offline**: it stopped cleanly. **unknown**: a hello but no status, or a status
      in no known state.

    Anything unreadable (a malformed hello, status or beat from any broker user) is
    counted under "refused" and noted on its board's row; it never stops the look.

    Example: `fedring fleet --broker mqtt://broker.lan:1883 --username operator
    --password-file operator.pw --watch`
    """
    from fedring.counters import Counters
    from fedring.fleet import BoardTable
    from fedring.fleet_watch import FleetReader
    from fedring.transport.mqtt_broker import BrokerRefused, BrokerUnreachable
    from fedring.transport.topics import COORDINATOR

    if username == COORDINATOR:
        raise typer.BadParameter(
            f"{COORDINATOR!r} is the coordinator's user: a broker that binds client ids to "
            "user names would throw the running coordinator off it. Use a user of the "
            "operator's own (examples/mosquitto.acl: user operator)",
            param_hint="--username",
        )
    cfg = broker_config(broker, username, password_file, ca, cert, key, 10)
    cfg = dataclasses.replace(cfg, connect_timeout_s=min(cfg.connect_timeout_s, timeout))
    table = BoardTable(Counters())
    reader = FleetReader(cfg, table)
    try:
        reader.start()
    except (BrokerUnreachable, BrokerRefused) as exc:
        err.print(f"[red]error: {escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    began = time.monotonic()
    try:
        if watch:
            _watch(reader, as_json, began, timeout)
        else:
            _settle(reader, began + timeout)
            doc = snapshot(reader, began)
            if as_json:
                typer.echo(json.dumps(doc, sort_keys=True))
            else:
                _print(doc)
    finally:
        reader.close()


def _settle(reader: Any, until: float) -> None:
    """Listen until what is retained is in and every online board is decided."""
    while time.monotonic() < until:
        now = time.monotonic()
        if reader.retained_in.is_set() and reader.table.decided(now):
            return
        time.sleep(0.05)


def snapshot(reader: Any, began: float) -> dict[str, Any]:
    """The look as one JSON-ready object."""
    now = time.monotonic()
    table = reader.table
    coordinator = table.coordinator(now)
    warnings = [f"the broker refused to let this user read {t}" for t in reader.refused]
    warnings += table.warnings(now)
    boards = table.boards(now)
    user = reader.cfg.username
    if user is not None and any(b.id == user for b in boards):
        warnings.append(f"connected as board {user!r}'s own user: a broker that binds client "
                        "ids to user names has thrown that board off")  # fmt: skip
    return {
        "broker": reader.cfg.url,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "listened_s": round(now - began, 2),
        "boards": [b.as_dict() for b in boards],
        "coordinator": coordinator.as_dict() if coordinator else None,
        "refused": dict(sorted(table.counters.snapshot().items())),
        "warnings": warnings,
    }


def render(doc: dict[str, Any]) -> Table:
    """The boards as a rich table (text as `Text`: nothing a board says is markup)."""
    boards = doc["boards"]
    counts = {s: sum(b["state"] == s for b in boards) for s in COLOURS}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no boards"
    table = Table(title=f"{doc['broker']}: {summary}", title_justify="left")
    for name in ("board", "state", "profile", "arch", "fedring", "torch"):
        table.add_column(name)
    for name in ("RSS", "memory", "beat", "up"):
        table.add_column(name, justify="right")
    table.add_column("job")
    now = time.time()
    for b in boards:
        up = now - b["started"] if b["started"] else None
        table.add_row(
            Text(b["id"]), Text(b["state"], style=COLOURS.get(b["state"], "")),
            Text(b["profile"] + (f"/{b['link']}" if b["link"] else "") or "-"),
            Text(b["arch"] or "-"), Text(b["fedring"] or "-"), Text(b["torch"] or "-"),
            Text(size(b["rss_bytes"])), Text(size(b["mem_total_bytes"])),
            Text("-" if b["last_beat_s"] is None else f"{b['last_beat_s']:.1f} s"),
            Text(duration(up)), Text(b["job"] or "-"),
        )  # fmt: skip
    return table


def _footer(doc: dict[str, Any]) -> list[str]:
    lines = [f"{b['id']}: {b['state']}: {b['why']}" for b in doc["boards"]
             if b["state"] in ("lost", "unknown")]  # fmt: skip
    lines += [f"{b['id']}: {note}" for b in doc["boards"] for note in b["notes"]]
    coordinator = doc["coordinator"]
    if coordinator is not None:
        lines.append(f"coordinator: {coordinator['state']} ({coordinator['why']})")
    if doc["refused"]:
        lines.append("refused: " + ", ".join(f"{k} {v}" for k, v in doc["refused"].items()))
    return lines + [f"warning: {w}" for w in doc["warnings"]]


def _print(doc: dict[str, Any]) -> None:
    out = Console()
    out.print(render(doc))
    for line in _footer(doc):
        out.print(Text(line))


def _watch(reader: Any, as_json: bool, began: float, timeout: float) -> None:
    """Draw once every board is decided (at most `timeout` s), then redraw every
    REDRAW_S and at once when a board's state changes, until Ctrl-C or SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _settle(reader, began + timeout)
    live = Live(console=Console(), auto_refresh=False) if sys.stdout.isatty() and not as_json \
        else None  # fmt: skip
    states: dict[str, str] = {}
    drawn = -REDRAW_S
    try:
        if live is not None:
            live.start()
        while not stop.is_set():
            doc = snapshot(reader, began)
            now_states = {b["id"]: b["state"] for b in doc["boards"]}
            changed = now_states != states
            if changed or time.monotonic() - drawn >= REDRAW_S:
                if live is not None:
                    live.update(render(doc), refresh=True)
                elif as_json:
                    typer.echo(json.dumps(doc, sort_keys=True))
                elif not states:
                    _print(doc)
                else:
                    _changes(doc, states)
                sys.stdout.flush()
                states, drawn = now_states, time.monotonic()
            stop.wait(TICK_S)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()


def _changes(doc: dict[str, Any], before: dict[str, str]) -> None:
    """One plain line per board that appeared or changed state since `before`."""
    stamp = datetime.now().strftime("%H:%M:%S")
    for b in doc["boards"]:
        old = before.get(b["id"])
        if old != b["state"]:
            what = "appeared" if old is None else f"{old} ->"
            typer.echo(f"{stamp} {b['id']} {what} {b['state']}: {b['why']}")


def size(n: int | None) -> str:
    """Bytes as MiB or GiB ("-": not announced)."""
    if n is None:
        return "-"
    if n >= 10 * 2**30:
        return f"{n / 2**30:.0f} GiB"
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB"


def duration(seconds: float | None) -> str:
    """An uptime as 42 s, 7 min, 3.2 h or 12 d ("-": unknown)."""
    if seconds is None or seconds < 0:
        return "-"
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f} {unit}" if unit != "min" else f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"

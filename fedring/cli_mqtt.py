"""`fedring agent` and `fedring coordinator run`: the deployed product, over MQTT.

    fedring agent --broker mqtt://broker.lan:1883 --id pi-01 --username pi-01 \\
        --password-file /etc/fedring/password
    fedring coordinator run examples/digits.toml --broker mqtt://broker.lan:1883 --out runs/d1

Passwords come from ``--password-file`` or ``$FEDRING_MQTT_PASSWORD`` (a flag
would show in ``ps``). Exit codes: 0 done, 1 failed run, 2 bad input.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

err = Console(stderr=True)
coordinator_app = typer.Typer(
    rich_markup_mode="markdown",  # not "rich": NAME[/LINK] and [defaults] stay literal
    help="Drive a training job over an MQTT broker.",
    no_args_is_help=True,
)


def row_text(row: dict[str, Any]) -> str:
    """A round's row as the progress bar shows it: loss, and accuracy when evaluated."""
    acc = row.get("accuracy")
    return f"loss {row.get('loss', 0.0):.3f}" + (f" acc {acc:.3f}" if acc is not None else "")


BROKER_HELP = "Broker URL: mqtt://HOST:PORT, or mqtts://HOST:PORT for TLS."


def broker_config(
    url: str, username: str | None, password_file: Path | None, ca: Path | None,
    cert: Path | None, key: Path | None, keepalive: int,
) -> Any:  # fmt: skip
    from fedring.transport.mqtt import BrokerConfig

    password = os.environ.get("FEDRING_MQTT_PASSWORD")
    if password_file is not None:
        try:
            password = password_file.read_text().strip()
        except OSError as exc:
            raise typer.BadParameter(
                f"cannot read {password_file}: {exc}", param_hint="--password-file"
            ) from None
    if ca is not None and not url.startswith("mqtts://"):
        raise typer.BadParameter("--ca needs an mqtts:// broker URL", param_hint="--ca")
    try:
        return BrokerConfig.parse(
            url, username=username or None, password=password, ca=str(ca) if ca else None,
            cert=str(cert) if cert else None, key=str(key) if key else None, keepalive=keepalive,
        )  # fmt: skip
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--broker") from None


_USER = typer.Option(None, "--username", help="Broker user name (one per agent).")
_PWFILE = typer.Option(
    None, "--password-file", help="File holding the broker password (or $FEDRING_MQTT_PASSWORD)."
)
# exists=True: a missing file is a usage error (exit 2) that names the option.
_CA = typer.Option(
    None, "--ca", exists=True, dir_okay=False,
    help="CA bundle that signed the broker's certificate (TLS).",
)  # fmt: skip
_CERT = typer.Option(
    None, "--cert", exists=True, dir_okay=False, help="Client certificate (TLS client auth)."
)
_KEY = typer.Option(
    None, "--key", exists=True, dir_okay=False, help="Client private key (TLS client auth)."
)
_KEEPALIVE_HELP = (
    "MQTT keep-alive, seconds; the link beats 3 times per keep-alive, and the coordinator "
    "takes a board silent for 1.25x this for lost (a hung board is seen within 1.5x)."
)
_KEEPALIVE = typer.Option(5, "--keepalive", min=2, max=600, help=_KEEPALIVE_HELP)
_AGENT_KEEPALIVE = typer.Option(
    None, "--keepalive", min=2, max=600, help=f"{_KEEPALIVE_HELP} [the profile's]"
)
_METRICS_PORT = typer.Option(
    None, "--metrics-port", min=0, max=65535, metavar="PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; the URL "
    "goes to stderr): rounds, bytes by kind, refusals, RSS, queues. [off]",
)  # fmt: skip
# `coordinator run` and `simulate` serve the same live page of a job
DASHBOARD = typer.Option(
    None, "--dashboard", min=0, max=65535, metavar="PORT",
    help="Serve a live dashboard of the job on PORT (0: a free one; the URL goes to "
    "stderr): curves, bytes, ring, events. Read-only. [off]",
)
DASHBOARD_HOST = typer.Option(
    "127.0.0.1", "--dashboard-host", help="Address the dashboard binds to. [loopback]"
)
_METRICS_HOST = typer.Option(
    "127.0.0.1", "--metrics-host", help="Address the metrics bind to. [loopback]"
)
_METRICS_HOLD = typer.Option(
    0.0, "--metrics-hold", min=0, max=3600, metavar="S",
    help="Keep /metrics up S seconds after the end, so that a scrape sees it. [0]",
)  # fmt: skip


def agent_cmd(
    broker: str = typer.Option(..., "--broker", help=BROKER_HELP),
    agent_id: str = typer.Option(..., "--id", help="This board's id (letters, digits, _ . -)."),
    data_dir: Path | None = typer.Option(
        None,
        "--data-dir",
        help="Where npz:PATH datasets live; a job's PATH must resolve under it (none: no npz).",
    ),
    profile: str = typer.Option(
        "auto",
        "--profile",
        help="Board profile: auto (detect), NAME[/wifi|/ethernet], or a file PATH.toml[/LINK].",
    ),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="torch threads for training. [the profile's]"
    ),
    username: str | None = _USER,
    password_file: Path | None = _PWFILE,
    ca: Path | None = _CA,
    cert: Path | None = _CERT,
    key: Path | None = _KEY,
    keepalive: int | None = _AGENT_KEEPALIVE,
    allow_task_module: list[str] = typer.Option(
        [], "--allow-task-module",
        help="A module this agent may import for a job's task = MODULE:ATTR or model = "
        "MODULE:FACTORY (repeatable). Tasks installed as packages (entry points "
        "'fedring.tasks') need no flag; code is never taken from the coordinator.",
    ),
    attack: str | None = typer.Option(
        None,
        "--attack",
        help="Test fixture for robust aggregation, never on by default: this agent poisons "
        "every job it joins: sign-flip | scale[:FACTOR] (-10) | noise[:SIGMA] | label-flip.",
    ),
    metrics_port: int | None = _METRICS_PORT,
    metrics_host: str = _METRICS_HOST,
    metrics_hold: float = _METRICS_HOLD,
) -> None:
    """Run the agent daemon: enrol with the broker, train when a coordinator calls.

    Stops cleanly on SIGTERM or Ctrl-C: halts any round, publishes "offline", exits 0.
    """
    from fedring.edge_agent.daemon import AgentDaemon
    from fedring.edge_agent.probe import agent_probe
    from fedring.engine.attack import Attack
    from fedring.firmware_profiles.apply import RUNTIME_MB, resolve, settings_for
    from fedring.firmware_profiles.schema import ProfileError
    from fedring.monitor.prometheus import MetricsError
    from fedring.monitor.serve import serving
    from fedring.transport.mqtt import (
        BrokerRefused,
        BrokerUnreachable,
        IdentityMismatch,
        check_identity,
    )
    from fedring.transport.topics import TopicError

    logging.getLogger().setLevel(min(logging.getLogger().level, logging.INFO))
    try:
        check_identity(agent_id, username or None)
    except IdentityMismatch as exc:
        raise typer.BadParameter(str(exc), param_hint="--id/--username") from None
    try:
        harness = Attack.parse(attack) if attack is not None else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--attack") from None
    try:
        board, link, why = resolve(profile)
        settings = settings_for(board, link, threads)
        cfg = broker_config(broker, username, password_file, ca, cert, key,
                            keepalive or settings.keepalive_s)  # fmt: skip
        daemon = AgentDaemon(cfg, agent_id, data_dir=data_dir, profile=settings.hello(),
                             threads=settings.torch_threads, budget=board,
                             allowed_modules=tuple(allow_task_module),
                             attack=harness)  # fmt: skip
    except ProfileError as exc:
        raise typer.BadParameter(str(exc), param_hint="--profile") from None
    except TopicError as exc:
        raise typer.BadParameter(str(exc), param_hint="--id") from None
    logging.getLogger(__name__).info(
        "profile %s (%s): RAM budget %d MB (+%d MB runtime allowance), %d torch threads; "
        "--profile NAME for another", board.name, why, board.ram_budget_mb, RUNTIME_MB,
        settings.torch_threads,
    )  # fmt: skip

    def stop(signum: int, _frame: Any) -> None:
        daemon.stop.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        with serving(daemon.feed, metrics_port=metrics_port, metrics_host=metrics_host,
                     probe=agent_probe(daemon), metrics_hold_s=metrics_hold):  # fmt: skip
            code = daemon.run()
    except MetricsError as exc:
        raise typer.BadParameter(str(exc), param_hint="--metrics-port/--metrics-host") from None
    except (BrokerUnreachable, BrokerRefused) as exc:
        err.print(f"[red]error: {escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    raise typer.Exit(code)


@coordinator_app.command("run")
def coordinator_run(
    job_file: Path = typer.Argument(..., help="TOML job file (see examples/digits.toml)."),
    broker: str = typer.Option(..., "--broker", help=BROKER_HELP),
    out: Path = typer.Option(Path("runs/latest"), "--out", help="Checkpoint and summary here."),
    resume: bool = typer.Option(False, "--resume", help="Carry on from OUT/checkpoint.pt."),
    min_agents: int = typer.Option(
        0, "--min-agents", min=0, help="Start with this many [job's agents]."
    ),
    enrol_timeout: float = typer.Option(
        120.0, "--enrol-timeout", min=1, help="Seconds to wait for agents."
    ),
    username: str | None = typer.Option("coordinator", "--username", help="Broker user name."),
    password_file: Path | None = _PWFILE,
    ca: Path | None = _CA,
    cert: Path | None = _CERT,
    key: Path | None = _KEY,
    keepalive: int = _KEEPALIVE,
    onnx: bool = typer.Option(
        True, "--onnx/--no-onnx", help="Export OUT/model.onnx at the end, checked with ORT."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary object on stdout."),
    quiet: bool = typer.Option(
        False, "--quiet", "-q",
        help="No progress line on stderr (it shows round / total, accuracy, loss, bytes, "
        "members and ETA, redrawn on a terminal, a line a second in a pipe or log).",
    ),
    pipeline_stages: int = typer.Option(
        0, "--pipeline-stages", min=0, max=64,
        help="Model parallelism: cut the model into S stages, one per agent (sets the job's "
        "pipeline_stages and agents to S; an S x D grid comes from the job file: agents = "
        "S x D; docs/pipeline.md). [the job file's]",
    ),
    dashboard: int | None = DASHBOARD,
    dashboard_host: str = DASHBOARD_HOST,
    metrics_port: int | None = _METRICS_PORT,
    metrics_host: str = _METRICS_HOST,
    metrics_hold: float = _METRICS_HOLD,
) -> None:
    """Enrol agents, shard the data, run the rounds, checkpoint every round, report."""
    from contextlib import ExitStack

    from fedring.config import JobSpec
    from fedring.coordinator.checkpoint import CheckpointError
    from fedring.coordinator.lease import CoordinatorBusy, lock_folder
    from fedring.coordinator.pipeline import PipelineCoordinator
    from fedring.coordinator.probe import RunnerProbe
    from fedring.coordinator.service import Coordinator, CoordinatorError, Options
    from fedring.monitor import JobFeed
    from fedring.monitor.dashboard import DashboardError
    from fedring.monitor.progress import ProgressLine
    from fedring.monitor.prometheus import MetricsError
    from fedring.monitor.serve import serving
    from fedring.transport.mqtt import BrokerRefused, BrokerUnreachable

    cfg = broker_config(broker, username, password_file, ca, cert, key, keepalive)
    # --enrol-timeout bounds the wait for the broker too (a refused one fails at once)
    cfg = dataclasses.replace(cfg, connect_timeout_s=min(cfg.connect_timeout_s, enrol_timeout))
    try:
        spec = JobSpec.from_toml(job_file)
        if pipeline_stages:
            spec = spec.replace(pipeline_stages=pipeline_stages, agents=pipeline_stages)
    except ValueError as exc:
        err.print(f"[red]error: {escape(str(exc))}[/red]")
        raise typer.Exit(2) from None
    try:  # one job, one coordinator: this folder here, the broker's id as the run connects
        lock = lock_folder(out)
    except CoordinatorBusy as exc:
        err.print(f"[red]error: {escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    feed, probe = JobFeed(rounds=spec.rounds, agents=min_agents or spec.agents), RunnerProbe()
    with lock, ExitStack() as views:
        try:
            views.enter_context(serving(feed, dashboard_port=dashboard, host=dashboard_host,
                                        metrics_port=metrics_port, metrics_host=metrics_host,
                                        probe=probe, metrics_hold_s=metrics_hold))  # fmt: skip
        except DashboardError as exc:
            err.print(f"[red]error: --dashboard: {escape(str(exc))}[/red]")
            raise typer.Exit(2) from None
        except MetricsError as exc:
            err.print(f"[red]error: --metrics-port: {escape(str(exc))}[/red]")
            raise typer.Exit(2) from None
        views.enter_context(ProgressLine(feed, quiet=quiet))
        opts = Options(out=out, min_agents=min_agents, enrol_timeout_s=enrol_timeout,
                       resume=resume, export_onnx=onnx, feed=feed)  # fmt: skip
        piped = spec.pipeline_stages > 1  # an S x D grid of agents: `coordinator.pipeline`
        try:
            probe.runner = (PipelineCoordinator if piped else Coordinator)(spec, cfg, opts)
            summary = probe.runner.run()
        except CheckpointError as exc:
            err.print(f"[red]error: {escape(str(exc))}[/red]")
            raise typer.Exit(2) from None
        except CoordinatorBusy as exc:
            err.print(f"[red]error: {escape(str(exc))}[/red]")
            raise typer.Exit(1) from None
        except (CoordinatorError, BrokerUnreachable, BrokerRefused) as exc:
            err.print(f"[red]run failed: {escape(str(exc))}[/red]")
            raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(summary, sort_keys=True))
    elif piped:
        err.print(summary["plan_text"])
        err.print(
            f"job {summary['job']}: accuracy {summary['final_accuracy']:.4f} after "
            f"{summary['rounds']} steps, {summary['layout']}, bubble "
            f"{summary['bubble_fraction']:.3f}, model sha256 {summary['model_sha256'][:16]}; "
            f"{out}/summary.json"
        )
    else:
        err.print(
            f"job {summary['job']}: accuracy {summary['final_accuracy']:.4f} after "
            f"{summary['rounds']} rounds, {len(summary['members'])} agents, "
            f"identical models: {summary['identical_models']}, "
            f"re-formations: {summary['reformations']}; {out}/summary.json"
        )
    exported = summary.get("onnx", {})
    if "error" in exported:
        err.print(f"[red]ONNX export failed its checks: {exported['error']}[/red]")
        raise typer.Exit(1)
    if exported and not as_json:
        from fedring.cli_export import summary_line

        err.print(summary_line(exported))


def bench_mqtt_cmd(
    agents: int = typer.Option(4, min=2, max=32, help="Agent daemons (processes) in the ring."),
    rounds: int = typer.Option(100, min=1, help="Rounds of each job."),
    density: float = typer.Option(0.01, min=1e-6, max=1.0, help="group-top-k fraction kept."),
    dataset: str = typer.Option("digits", help="digits | mnist1d | synthetic[:N:D:C]."),
    seed: int = typer.Option(0, help="Seed of both jobs."),
    checkpoint_every: int = typer.Option(
        1, min=1, help="Rounds between the head's dense checkpoint uploads."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Bytes per round at a real Mosquitto ($SYS) beside fedring's frame accounting.

    Starts Mosquitto on loopback and N `fedring agent` processes, then runs the
    same job dense and with group-top-k; needs `mosquitto` installed.
    """
    from rich.table import Table

    from fedring.bench import mqtt as bench
    from fedring.transport.mosquitto import MosquittoMissing

    with Progress(console=err, disable=not sys.stderr.isatty(), transient=True) as progress:
        task = progress.add_task("dense", total=2 * rounds)
        done = {"none": 0, "group-topk": rounds}

        def tick(compression: str, r: int, row: dict[str, Any]) -> None:
            progress.update(task, completed=done[compression] + r + 1,
                            description=f"{compression}: {row_text(row)}")  # fmt: skip

        try:
            result = bench.run(
                agents, rounds, density, dataset, seed, checkpoint_every, on_round=tick
            )
        except MosquittoMissing as exc:
            err.print(f"[red]error: {escape(str(exc))}[/red]")
            raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(result, sort_keys=True))
        return
    table = Table(title=f"{agents} agents, {dataset}, {rounds} rounds over Mosquitto, checkpoint "
                        f"every {checkpoint_every}: bytes per round")  # fmt: skip
    for title in ("job", "accuracy", "ring/agent", "published", "broker in", "broker out",
                  "MQTT +"):  # fmt: skip
        table.add_column(title, justify="right")
    for row in result["rows"]:
        name = "dense" if row["compression"] == "none" else f"top-k {100 * row['density']:g}%"
        table.add_row(
            name, f"{row['final_accuracy']:.4f}", f"{row['ring_bytes_per_agent_per_round']:,.0f}",
            f"{row['published_bytes_per_round']:,.0f}", f"{row['broker_received_per_round']:,.0f}",
            f"{row['broker_sent_per_round']:,.0f}", f"{100 * row['mqtt_overhead']:.1f}%",
        )  # fmt: skip
    Console().print(table)
    err.print(
        f"dense/compressed: ring {result['ring_bytes_ratio']:.1f}x, at the broker "
        f"{result['broker_bytes_ratio']:.1f}x; logs in {result['logs']}"
    )

"""`fedring lab`: run a job on real processes behind shaped links (root only)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

lab_app = typer.Typer(
    rich_markup_mode="markdown",  # not "rich": NAME[/LINK] and [defaults] stay literal
    help="The edge lab: agents in network namespaces behind tc-shaped links, Mosquitto in "
    "a hub namespace, the coordinator beside it. Needs root and iproute2.",
    no_args_is_help=True,
)
err = Console(stderr=True)


def time_to(rows: list[dict[str, Any]], target: float) -> float | None:
    """Seconds (the rows' `wall_s`) until accuracy first reached `target`, or None."""
    for row in rows:
        if row.get("accuracy", -1.0) >= target and "wall_s" in row:
            return float(row["wall_s"])
    return None


@lab_app.command("run")
def run_cmd(
    agents: int = typer.Option(4, "--agents", min=1, max=200, help="Agent namespaces."),
    bandwidth: float = typer.Option(
        10.0, "--bandwidth", help="Each agent's uplink in Mbit/s (tc tbf)."
    ),
    downlink: float | None = typer.Option(
        None, "--downlink", help="Each agent's downlink in Mbit/s. [= --bandwidth]"
    ),
    loss: float = typer.Option(
        0.0, "--loss", help="Fraction of packets dropped each way on every agent link (nftables)."
    ),
    delay_ms: float = typer.Option(
        0.0, "--delay-ms", help="Added each way between agents and the broker (user-space proxy)."
    ),
    job: Path | None = typer.Option(None, "--job", help="TOML job file; flags below override."),
    dataset: str | None = typer.Option(None, help="digits | mnist1d | synthetic[:N:D:C]."),
    model: str | None = typer.Option(None, help="mlp | mlp:W1xW2... | cnn. [mlp]"),
    compression: str | None = typer.Option(None, help="none | group-topk. [group-topk]"),
    sync: str | None = typer.Option(None, help="sync | local | adaptive. [sync]"),
    collective: str | None = typer.Option(
        None,
        help="ring | fanout (one broadcast each) | hub (rank 0 sums, broadcasts) | auto (the "
        "coordinator predicts each from the agents' probes and takes the fastest). [ring]",
    ),
    rounds: int | None = typer.Option(None, help="Rounds. [600]"),
    target_accuracy: float | None = typer.Option(None, help="Stop once reached. [0: never]"),
    profile: str = typer.Option(
        "", "--profile", help="Agents' board profile NAME[/LINK]. [auto: this machine]"
    ),
    out: Path = typer.Option(Path("runs/lab"), "--out", help="Logs, summary and metrics here."),
    timeout: float = typer.Option(1800.0, "--timeout", help="Give up after this many seconds."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Build the lab, start one agent daemon per namespace, run the job, tear it all down.

    Example: fedring lab run --agents 4 --bandwidth 10 --model mlp:512x512 --target-accuracy 0.95
    """
    from fedring.config import JobSpec
    from fedring.lab import netns
    from fedring.lab.impair import NftError
    from fedring.lab.lab import Lab, LabRunError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    why = netns.can_build()
    if why:
        err.print(f"[red]error: {escape(why)}[/red]")
        raise typer.Exit(2)
    flags = {"dataset": dataset, "model": model, "compression": compression, "sync": sync,
             "collective": collective, "rounds": rounds,
             "target_accuracy": target_accuracy}  # fmt: skip
    changes: dict[str, Any] = {k: v for k, v in flags.items() if v is not None}
    try:
        spec = JobSpec.from_toml(job, changes) if job else JobSpec(**changes)
        spec = spec.replace(agents=agents)
    except (ValueError, TypeError) as exc:
        err.print(f"[red]error: {escape(str(exc))}[/red]")
        raise typer.Exit(2) from None
    try:
        with (
            Lab(
                agents,
                bandwidth,
                downlink_mbps=downlink,
                workdir=out,
                profile=profile,
                loss=loss,
                delay_ms=delay_ms,
            ) as lab,
            err.status(f"{agents} agents at {bandwidth:g} Mbit/s: running (logs in {out})"),
        ):
            lab.start_agents()
            result = lab.run_job(spec, timeout_s=timeout, onnx=True)
            dropped = lab.dropped()
    except (LabRunError, netns.LabError, NftError, ValueError) as exc:
        err.print(f"[red]lab run failed: {escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    summary = result["summary"]
    sent = [b[0] for b in result["link_bytes"].values()]
    received = [b[1] for b in result["link_bytes"].values()]
    brief = {
        "agents": agents, "bandwidth_mbps": bandwidth, "final_accuracy": summary["final_accuracy"],
        "rounds": summary["rounds"], "identical_models": summary["identical_models"],
        "seconds_to_target": time_to(result["rows"], spec.target_accuracy)
        if spec.target_accuracy else None,
        "training_seconds": result["rows"][-1].get("wall_s") if result["rows"] else None,
        "wall_seconds": result["wall_seconds"],
        "link_bytes_sent_per_agent": sum(sent) / len(sent),
        "link_bytes_received_per_agent": sum(received) / len(received), "out": result["out"],
        "loss": loss, "delay_ms": delay_ms, "packets_dropped": sum(dropped.values()),
    }  # fmt: skip
    if as_json:
        typer.echo(json.dumps(brief, sort_keys=True))
        return
    table = Table(title=f"fedring lab: {agents} agents at {bandwidth:g} Mbit/s")
    table.add_column("field")
    table.add_column("value", justify="right")
    for key, value in brief.items():
        table.add_row(key, f"{value:,.4g}" if isinstance(value, float) else str(value))
    Console().print(table)


@lab_app.command("clean")
def clean_cmd(
    every: bool = typer.Option(
        False, "--all", help="Also labs whose owner is alive. [only orphans]"
    ),
) -> None:
    """Delete lab namespaces left by a lab whose process died (ending what runs inside)."""
    from fedring.lab import netns

    targets = netns.stale(every)
    left = netns.destroy(targets)
    for ns in targets:
        print(f"{'left' if ns in left else 'removed'} {ns}")
    if not targets:
        print("no lab namespaces to remove", file=sys.stderr)
    if left:
        raise typer.Exit(1)


def bench_lab_cmd(
    agents: int = typer.Option(4, "--agents", min=1, max=200, help="Agent namespaces."),
    bandwidth: float = typer.Option(10.0, "--bandwidth", help="Every agent's link, Mbit/s."),
    task: list[str] = typer.Option(
        ["digits", "mnist1d"], "--task", help="digits (mlp:512x512 to 95%) | mnist1d (cnn)."
    ),
    method: list[str] = typer.Option(
        [], "--method", help="Only these methods (repeat the flag). [all]"
    ),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("runs/edge-lab"), "--out", help="Logs, JSON, plot, report."),
    timeout: float = typer.Option(900.0, "--timeout", help="Per method, seconds."),
    overlap: bool = typer.Option(
        False, "--overlap", help="Instead: sync step times with and without overlap (2 agents)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """fedring (compressed sync and local, dense) beside Flower FedAvg and gloo DDP on the
    same shaped links: time to target accuracy, bytes per agent, final accuracy."""
    from fedring.bench import edge_lab
    from fedring.lab import netns

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    why = netns.can_build()
    unknown = [t for t in task if t not in edge_lab.TASKS]
    if why or unknown:
        err.print(f"[red]error: {escape(why or f'--task {unknown}: expected digits, mnist1d')}")
        raise typer.Exit(2)

    if overlap:
        found = edge_lab.overlap(out=out, timeout_s=timeout)
        print(json.dumps(found, sort_keys=True) if as_json else edge_lab.overlap_table(found))
        return

    def tell(row: edge_lab.Row) -> None:
        secs = f"{row.seconds_to_target:.1f} s" if row.seconds_to_target else "not reached"
        err.print(
            f"{escape(row.task)} | {escape(row.method)}: {secs}, final "
            f"{row.final_accuracy:.4f}, {row.bytes_sent_per_agent / 1e6:.2f} MB sent/agent"
        )

    doc = edge_lab.run(agents, bandwidth, tuple(task), tuple(method), seed, out, timeout,
                       edge_lab.default_baselines(), tell)  # fmt: skip
    if as_json:
        typer.echo(json.dumps(doc, sort_keys=True))
        return
    print(edge_lab.table(doc))
    print(f"\nplot: {doc['plot']}  ({doc['bench_seconds']:.0f} s in all)")


GRID_DEFAULTS: dict[str, list[Any]] = {
    "model": ["mnist1d/cnn", "digits/mlp:512x512"], "bandwidth": [1.0, 10.0],
    "delay_ms": [0.0, 20.0], "agents": [4],
    "method": ["ring", "fanout", "hub", "auto", "auto-codec", "dense", "flower", "ddp",
               "powersgd2", "powersgd4"],
}  # fmt: skip


def bench_grid_cmd(
    model: list[str] | None = typer.Option(
        None, "--model",
        help="DATASET/MODEL (digits to 95%, mnist1d to 85%) or mnist1d-cnn | digits-mlp | "
        "mlp512 | mlp1024 (about 1 M parameters); repeat the flag. [default: mnist1d/cnn, "
        "digits/mlp:512x512]",
    ),
    bandwidth: list[float] | None = typer.Option(
        None, "--bandwidth", help="Mbit/s per agent. [default: 1, 10]"
    ),
    delay_ms: list[float] | None = typer.Option(
        None, "--delay-ms", help="Added one-way delay. [default: 0, 20]"
    ),
    agents: list[int] | None = typer.Option(
        None, "--agents", help="N agents; repeat the flag. [default: 4]"
    ),
    method: list[str] | None = typer.Option(
        None, "--method", help="ring | fanout | hub | auto (group-top-k 1% + EF) | auto-codec "
        "(compression and collective auto) | dense | flower | ddp | powersgd2 | powersgd4; "
        "repeat the flag. [default: all]",
    ),
    cap_s: float | None = typer.Option(
        None, "--cap-s", help="Training seconds per run at most. [default: 60, or --resume's]"
    ),
    budget_s: float | None = typer.Option(
        None, "--budget-s", help="Start no cell after this many seconds; list the rest."
    ),
    seed: int | None = typer.Option(None, "--seed", help="[default: 0, or --resume's]"),
    out: Path = typer.Option(Path("runs/lab-grid"), "--out", help="grid.json, grid.md, grid.png."),
    timeout: float = typer.Option(600.0, "--timeout", help="Per run, seconds, start-up included."),
    resume: Path | None = typer.Option(
        None, "--resume", metavar="DIR",
        help="Go on with the grid in DIR (its --out): keep the runs in DIR/grid.json and run "
        "only the missing ones, over its models, links, N and methods and any given here; "
        "its cap and seed unless given (another is refused). The table and plot are re-made "
        "from all. With --budget-s, a grid finished in sittings.",
    ),
    report_only: bool = typer.Option(
        False, "--report-only",
        help="Run nothing: re-make OUT/grid.md and grid.png from OUT/grid.json (and each "
        "fedring run's metrics under OUT).",
    ),
) -> None:
    """Time to target for every method in every cell (N x bandwidth x delay x model):
    fedring's collectives (and `auto`) beside the dense ring, Flower, DDP and PowerSGD;
    `--resume DIR` goes on with a grid begun before."""
    import json
    import time

    from fedring.bench import lab_grid
    from fedring.lab import netns

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out = resume or out
    if report_only:
        try:
            doc = json.loads((out / "grid.json").read_text())
        except (OSError, ValueError) as exc:
            err.print(f"[red]error: --report-only needs {escape(str(out / 'grid.json'))}: "
                      f"{escape(str(exc))}[/red]")  # fmt: skip
            raise typer.Exit(2) from None
        lab_grid.write(lab_grid.fill_round_ms(doc, out), out)
        print((out / "grid.md").read_text())
        return
    try:
        before = lab_grid.stored(resume, cap_s, seed) if resume is not None else None
        stored = before or {"cap_s": 60.0, "seed": 0}  # a resumed grid's own unless given
        cap_s = float(stored["cap_s"]) if cap_s is None else cap_s
        seed = int(stored["seed"]) if seed is None else seed

        def axis(name: str) -> list[Any]:
            """A flag not given: a resumed grid's own axis (nothing to add), else the default."""
            return [] if before is not None else GRID_DEFAULTS[name]

        models = tuple(lab_grid.parse_model(m) for m in (model or axis("model")))
        methods = lab_grid.check_methods(method) if method else tuple(axis("method"))
        bandwidths: tuple[float, ...] = tuple(bandwidth or axis("bandwidth"))
        delays: tuple[float, ...] = tuple(delay_ms or axis("delay_ms"))
        sizes: tuple[int, ...] = tuple(agents or axis("agents"))
        if cap_s <= 0 or any(b <= 0 for b in bandwidths) or any(d < 0 for d in delays):
            raise lab_grid.GridError("--cap-s and --bandwidth must be > 0, --delay-ms >= 0")
    except (lab_grid.GridError, lab_grid.ResumeError) as exc:
        err.print(f"[red]error: {escape(str(exc))}[/red]")
        raise typer.Exit(2) from None
    why = netns.can_build()
    if why:
        err.print(f"[red]error: {escape(why)}[/red]")
        raise typer.Exit(2)
    start = time.monotonic()
    done: list[lab_grid.Run] = []

    def tell(run: lab_grid.Run) -> None:
        done.append(run)
        secs = (f"{run.seconds_to_target:.1f} s" if run.seconds_to_target is not None
                else "error" if run.error and not run.curve
                else f"> {run.cap_s:g} s (best {run.best_accuracy:.3f})")  # fmt: skip
        cell = len({(r.agents, r.bandwidth_mbps, r.delay_ms, r.model) for r in done})
        chose = f" {escape(run.collective)}" if run.method in ("auto", "auto-codec") else ""
        cpu = f" cpu {run.agents_cpu_share:.2f}" if run.agents_cpu_share is not None else ""
        err.print(
            f"[{time.monotonic() - start:6.0f} s] cell {cell} N={run.agents} "
            f"{run.bandwidth_mbps:g} Mbit/s +{run.delay_ms:g} ms {escape(run.model)} | "
            f"{run.method}: {secs}{chose}{cpu}"
            f"{'' if run.delay_applied else ' (no added delay)'}"
            f"{' ERROR ' + escape(run.error[:200]) if run.error else ''}"
        )

    doc = lab_grid.run(models, bandwidths, delays, sizes, methods,
                       cap_s=cap_s, budget_s=budget_s, seed=seed, out=out, timeout_s=timeout,
                       on_run=tell, resume=resume is not None)  # fmt: skip
    print((out / "grid.md").read_text())
    print(f"json: {out / 'grid.json'}  plot: {doc.get('plot')}  "
          f"({doc['bench_seconds']:.0f} s in all)")  # fmt: skip

"""`fedring simulate`: a job's agents trained in one process over the in-process transport.

    fedring simulate --agents 4 --dataset digits --rounds 200 --json
    fedring simulate --config examples/own_model.toml --out runs/own

Most of the module is the command's signature: typer reads the options from it, and
`simulate` takes every JobSpec field as a flag with its help text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedring import cli_export
from fedring.cli_mqtt import DASHBOARD, DASHBOARD_HOST
from fedring.monitor import JobFeed
from fedring.monitor.progress import ProgressLine

err = Console(stderr=True)


def simulate_cmd(
    config: Path | None = typer.Option(None, "--config", help="TOML job file; flags override it."),
    agents: int | None = typer.Option(None, help="Number of agents N. [4]"),
    dataset: str | None = typer.Option(
        None, help="digits | mnist1d | synthetic[:N:D:C] | npz:PATH. [digits]"
    ),
    model: str | None = typer.Option(None, help="mlp | cnn | MODULE:FACTORY. [mlp]"),
    task: str | None = typer.Option(
        None,
        help="Your own task instead of --dataset/--model: an entry-point name (group "
        "fedring.tasks) or MODULE:ATTR importable here (see examples/own_model.py).",
    ),
    sharding: str | None = typer.Option(None, help="iid | dirichlet:ALPHA | quantity:BETA. [iid]"),
    compression: str | None = typer.Option(None, help="none | group-topk. [group-topk]"),
    density: str | None = typer.Option(
        None,
        help="Fraction kept per group, or auto: chosen with its warm-up and a closing flush "
        "from --rounds, --sync and --sample for at least --saving x fewer bytes than dense "
        "(the choice and its reason are in the summary's density_auto). [auto]",
    ),
    saving: float | None = typer.Option(
        None, help="density auto: at least this many times fewer bytes than dense. [3]"
    ),
    group_size: int | None = typer.Option(None, help="G, entries per group. [256]"),
    value_dtype: str | None = typer.Option(None, help="fp32 | fp16 | bf16 | int8. [fp16]"),
    error_feedback: bool | None = typer.Option(
        None, "--error-feedback/--no-error-feedback", help="[on]"
    ),
    policy: str | None = typer.Option(None, help="Sparse ring policy: bounded | exact. [bounded]"),
    topology: str | None = typer.Option(
        None,
        help="auto | ring | torus (2-D ring: same bytes, fewer steps) | star (allows "
        "median/trimmed). auto = torus from 9 agents when N = R x C with R >= 3. [auto]",
    ),
    collective: str | None = typer.Option(
        None,
        help="ring (2(N-1) steps) | fanout (each broadcasts once, all sum) | hub (rank 0 sums "
        "and broadcasts once): one step instead of 2(N-1) where a round is latency | auto "
        "(the smallest round an alpha-beta model predicts from the members' probes; "
        "in-process: codec cost only, no link). [ring]",
    ),
    sync: str | None = typer.Option(None, help="sync | local | adaptive | async. [sync]"),
    local_steps: int | None = typer.Option(
        None, help="H, local steps per round (local/adaptive/async). [4]"
    ),
    aggregation: str | None = typer.Option(
        None, help="mean | weighted | vote | hybrid:L[-L2] | median | trimmed:B | clip[:TAU]."
    ),
    sample: float | None = typer.Option(
        None,
        help="star: agents trained per round, a fraction in (0, 1] or a number >= 2 "
        "(seeded). [1.0: all]",
    ),
    sit_out: str | None = typer.Option(
        None, help="Residual of an agent back from sitting out: keep | reset | decay:G. [keep]"
    ),
    async_wait: int | None = typer.Option(None, help="async: apply after this many updates. [1]"),
    slow: str | None = typer.Option(
        None, help="async: speed factors, e.g. 3:0 (agent 0 is 3x slower)."
    ),
    rounds: int | None = typer.Option(None, help="Communication rounds. [600]"),
    batch_size: int | None = typer.Option(None, help="Per-agent batch size. [32]"),
    lr: float | None = typer.Option(
        None,
        help="Base learning rate for one node (x N with linear scaling). "
        "[auto: 0.1 for group-top-k sync (plain EF-SGD), else 0.025]",
    ),
    lr_scaling: str | None = typer.Option(None, help="linear | sqrt | none. [linear]"),
    warmup_steps: int | None = typer.Option(None, help="Gradual warm-up steps. [50]"),
    momentum: float | None = typer.Option(
        None,
        help="SGD momentum for dense rings, local steps and async. Group-top-k sync "
        "uses none unless --momentum-correction. [0.9]",
    ),
    momentum_correction: bool | None = typer.Option(
        None,
        "--momentum-correction/--no-momentum-correction",
        help="Group-top-k sync: momentum inside error feedback (DGC). Lags or collapses "
        "with 8+ non-iid agents; plain EF-SGD is the default. [off]",
    ),
    eval_every: int | None = typer.Option(None, help="Rounds between evaluations. [10]"),
    bucket_kb: int | None = typer.Option(
        None,
        help="Sync: all-reduce the gradient in buckets of about this many KB while "
        "backward runs (overlap); per-round compute_s, comm_s, step_s in the rows. [0 = off]",
    ),
    update_delay: int | None = typer.Option(
        None,
        help="Sync: 1 applies each agreed gradient one round late, so the ring runs during "
        "the next round's compute (SEEDS D). [0 = off]",
    ),
    pipeline_stages: int | None = typer.Option(
        None,
        help="Model parallelism: cut the model into S stages; the agents form an S x D grid "
        "(docs/pipeline.md). [1 = off]",
    ),
    micro_batches: int | None = typer.Option(
        None, help="Pipeline: micro-batches per replica batch. [4]"
    ),
    pipeline_schedule: str | None = typer.Option(None, help="Pipeline: gpipe | 1f1b. [1f1b]"),
    activation_dtype: str | None = typer.Option(
        None, help="Pipeline: activations on the wire, fp32 | fp16. [fp32]"
    ),
    pipeline_cost: str | None = typer.Option(
        None,
        help="Pipeline: split by counted multiply-adds (the same split and hash on any load) "
        "| measured (each layer timed here). [counted]",
    ),
    target_accuracy: float | None = typer.Option(None, help="Stop once reached (0 = never). [0]"),
    seed: int | None = typer.Option(None, help="Seed of split, shards, init and batches. [0]"),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Write metrics.jsonl, config.toml, summary.json, model.onnx (checked), "
        "report.md and its PNG plots here.",
    ),
    fleet: str | None = typer.Option(
        None,
        "--fleet",
        help="Estimate wall time on boards: NAME[/wifi|/ethernet][:COUNT],... e.g. "
        "rpi4:4,jetson-orin-nano:2 (sets --agents; see `fedring profile list`).",
    ),
    with_dense: bool = typer.Option(
        False, "--with-dense", help="Also run the dense fp32 ring; report and plot it beside."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary object on stdout."),
    quiet: bool = typer.Option(
        False, "--quiet", "-q",
        help="No progress line on stderr (round / total, accuracy, loss, bytes, ETA).",
    ),
    attack: str | None = typer.Option(
        None,
        "--attack",
        help="Test harness for robust aggregation, never on by default: the last --attackers "
        "agents attack with sign-flip | scale[:FACTOR] (-10) | noise[:SIGMA] (x the update's "
        "RMS, 10) | label-flip (summary: attack).",
    ),
    attackers: int = typer.Option(1, "--attackers", min=1, help="With --attack: how many. [1]"),
    dashboard: int | None = DASHBOARD,
    dashboard_host: str = DASHBOARD_HOST,
) -> None:
    """Train N agents in one process over the in-process transport (real frames)."""
    given = {k: v for k, v in locals().items() if v is not None}  # before any other local
    cli_only = ("config", "out", "as_json", "fleet", "with_dense", "attack", "attackers",
                "quiet", "dashboard", "dashboard_host")
    flags = {k: v for k, v in given.items() if k not in cli_only}
    if flags.get("density", "auto") != "auto":
        try:
            flags["density"] = float(flags["density"])
        except ValueError:
            typer.echo(f"error: --density {flags['density']!r} must be a number or auto", err=True)
            raise typer.Exit(2) from None
    from fedring.config import JobSpec
    from fedring.engine.attack import Attack
    from fedring.monitor.dashboard import DashboardError
    from fedring.monitor.serve import serving
    from fedring.report import write_report_for
    from fedring.sim import fleet as fleet_clock
    from fedring.sim.report import BASELINE_KEYS, dense_twin, write_outputs
    from fedring.sim.runner import simulate

    try:
        members = fleet_clock.parse_fleet(fleet) if fleet is not None else None
        if members is not None:
            flags.setdefault("agents", len(members))
        spec = JobSpec.from_toml(config, flags) if config else JobSpec.from_mapping(flags)
        harness = Attack.parse(attack) if attack is not None else None
        piped = spec.pipeline_stages > 1  # stages are fitted to the boards' budgets instead
        if members is not None and not piped:
            fleet_clock.check_fleet(spec, members)  # before training: size and memory
        elif members is not None and len(members) != spec.agents:
            raise fleet_clock.FleetError(
                f"--fleet has {len(members)} boards but the job has agents={spec.agents}"
            )
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)  # unwrapped: the numbers stay readable
        raise typer.Exit(2) from None
    profiles = [m.profile for m in members] if members is not None and piped else None
    host = fleet_clock.measure_host(spec) if members is not None and not piped else None
    onnx: dict[str, Any] = {}
    done = cli_export.export_after_run(out, spec.seed, onnx) if out is not None else None
    dense_spec = dense_twin(spec)
    baseline = None
    try:
        feed = sim_feed(spec, spec.compression)
        with serving(feed, dashboard_port=dashboard, host=dashboard_host), \
                ProgressLine(feed, quiet=quiet):  # fmt: skip
            summary = simulate(spec, on_round=lambda _r, row: feed.round(row), on_done=done,
                               fleet=profiles, attack=harness, attackers=attackers)  # fmt: skip
            feed.finish()
        if with_dense and dense_spec != spec:
            twin = sim_feed(dense_spec, "dense twin")
            with ProgressLine(twin, quiet=quiet):
                baseline = simulate(dense_spec, fleet=profiles,
                                    on_round=lambda _r, row: twin.round(row))  # fmt: skip
                twin.finish()
    except (ValueError, FileNotFoundError, DashboardError) as exc:  # refused input, a busy port
        err.print(f"[red]error: {escape(str(exc))}[/red]")
        raise typer.Exit(2) from None
    except Exception as exc:
        err.print(f"[red]run failed: {type(exc).__name__}: {escape(str(exc))}[/red]")
        raise typer.Exit(1) from None
    if members is not None and piped:
        from fedring.sim.pipeline_clock import estimate_pipeline

        summary.update(estimate_pipeline(spec, summary, members))
        if baseline is not None:
            baseline.update(estimate_pipeline(dense_spec, baseline, members))
    if members is not None and host is not None:
        summary.update(fleet_clock.estimate(spec, summary, members, host))
        if baseline is not None:
            baseline.update(fleet_clock.estimate(dense_spec, baseline, members, host))
    if baseline is not None:
        summary["dense_baseline"] = {k: baseline.get(k) for k in BASELINE_KEYS}
    if out is not None:
        summary["onnx"] = onnx
        summary["outputs"] = write_outputs(out, spec, summary)
        summary["outputs"].update(write_report_for(out, spec, summary, baseline))
    brief = {k: v for k, v in summary.items() if k not in ("rows", "manifest")}
    if as_json:
        typer.echo(json.dumps(brief, sort_keys=True))
    else:
        if "plan_text" in brief:
            Console().print(escape(brief["plan_text"]))
        Console().print(_simulate_table(spec, brief))
    if "error" in onnx:
        err.print(f"[red]ONNX export failed its checks: {escape(str(onnx['error']))}[/red]")
        raise typer.Exit(1)


def sim_feed(spec: Any, what: str) -> JobFeed:
    """The feed of one simulated job: its agents, named as in the summary."""
    feed = JobFeed(job=f"simulate {what}", rounds=spec.rounds, agents=spec.agents)
    feed.members([f"a{i}" for i in range(spec.agents)], spec.sync)
    return feed


def _simulate_table(spec: Any, r: dict[str, Any]) -> Table:
    table = Table(
        title=f"simulate: {spec.agents} agents, {spec.task or f'{spec.dataset}, {spec.model}'}, "
        f"{spec.sync}"
    )
    table.add_column("", justify="right")
    table.add_column("value", justify="right")
    table.add_row("final accuracy", f"{r['final_accuracy']:.4f}")
    table.add_row("rounds", str(r["rounds"]))
    table.add_row("layout", str(r.get("layout", "")))
    table.add_row("bytes sent per agent", f"{r['bytes_sent_per_agent']:,.0f}")
    table.add_row("dense fp32 ring would send", f"{r['dense_equivalent_bytes']:,.0f}")
    table.add_row("identical models", str(r["identical_models"]))
    table.add_row("rollbacks", str(r["rollbacks"]))
    table.add_row("wall seconds", f"{r['wall_seconds']:.1f}")
    if "bubble_fraction" in r:
        table.add_row("pipeline bubble fraction", f"{r['bubble_fraction']:.3f}")
        table.add_row("samples/s on this host", f"{r['throughput_samples_per_s']:,.0f}")
        table.add_row("samples/s, S x D machines (est.)",
                      f"{r['throughput_estimate_samples_per_s']:,.0f}")  # fmt: skip
    if "sim_seconds" in r:
        to_target = r["sim_seconds_to_target"]
        table.add_row(f"simulated seconds on {r['fleet']}", f"{r['sim_seconds']:.1f}")
        table.add_row(
            f"simulated seconds to accuracy {r['sim_target_accuracy']}",
            "not reached" if to_target is None else f"{to_target:.1f}",
        )
    return table

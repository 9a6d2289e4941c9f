"""`fedring bench compress` and `fedring bench ring`: fedring's codec and ring beside
their baselines, measured in the same run.

    fedring bench compress --numel 10000000 --density 0.01 --json
    fedring bench ring --agents 8 --numel 1000000 --density 0.01

`fedring.cli` puts them in the `bench` group beside `bench mqtt` (`cli_mqtt`) and
`bench lab` and `bench grid` (`cli_lab`).
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

err = Console(stderr=True)


class ValueDtypeChoice(StrEnum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    int8 = "int8"
    sign = "sign"


def _emit(result: dict[str, Any], as_json: bool, table: Table) -> None:
    if as_json:
        typer.echo(json.dumps(result, sort_keys=True))
    else:
        Console().print(table)


def bench_compress(
    numel: int = typer.Option(10_000_000, min=1, help="Length of the flat gradient."),
    density: float = typer.Option(
        0.01, min=1e-6, max=1.0, help="Fraction of entries kept; k = round(density*G)."
    ),
    group_size: int = typer.Option(
        256, min=1, max=65536, help="G: entries per group (<=256: uint8 indices)."
    ),
    value_dtype: ValueDtypeChoice = typer.Option(
        ValueDtypeChoice.fp16, help="Wire dtype of kept values."
    ),
    repeats: int = typer.Option(5, min=1, help="Timing runs; the best is reported."),
    seed: int = typer.Option(0, help="Seed of the random gradient."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Group-top-k select+encode against a global torch.topk compressor (GRACE/DGC)."""
    from fedring.bench import compress

    r = compress.run(numel, density, group_size, value_dtype.value, repeats, seed)
    _emit(r, as_json, _compress_table(r))


def bench_ring(
    agents: int = typer.Option(
        8, min=1, max=256, help="The ring size of interest (always measured)."
    ),
    sweep: str = typer.Option(
        "2,4,8,16", help="More ring sizes to show how bytes scale with N ('' for none)."
    ),
    numel: int = typer.Option(1_000_000, min=1, help="Length of each agent's flat gradient."),
    density: float = typer.Option(0.01, min=1e-6, max=1.0, help="Fraction kept per group."),
    group_size: int = typer.Option(256, min=1, max=65536, help="G: entries per group."),
    value_dtype: ValueDtypeChoice = typer.Option(
        ValueDtypeChoice.fp16, help="Wire dtype of kept values."
    ),
    seed: int = typer.Option(0, help="Seed of the agents' random gradients."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Bytes per agent: dense ring, sparse exact and bounded rings, DGC sparse all-gather."""
    from fedring.bench import ring

    try:
        sizes = [int(s) for s in sweep.split(",") if s.strip()]
    except ValueError:
        err.print(f"[red]--sweep {sweep!r}: expected comma-separated ring sizes like 2,4,8[/red]")
        raise typer.Exit(2) from None
    if any(not 1 <= s <= 256 for s in sizes):
        err.print(f"[red]--sweep {sweep!r}: every ring size must be in [1, 256][/red]")
        raise typer.Exit(2)
    worlds = sorted({agents, *sizes})
    with Progress(console=err, disable=not sys.stderr.isatty(), transient=True) as progress:
        task = progress.add_task("ring sizes", total=len(worlds))
        r = ring.run(
            agents,
            sizes,
            numel,
            density,
            group_size,
            value_dtype.value,
            seed,
            on_row=lambda _: progress.advance(task),
        )
    _emit(r, as_json, _ring_table(r))


def _compress_table(r: dict[str, Any]) -> Table:
    table = Table(
        title=f"compress {r['numel']:,} fp32, density {r['density']} "
        f"(k={r['k']} of G={r['group_size']})"
    )
    for col in ("", "fedring group-top-k", "global torch.topk", "DGC sampled"):
        table.add_column(col, justify="right")
    table.add_row(
        "select+encode ms",
        f"{r['group_topk_ms']:.1f}",
        f"{r['global_topk_ms']:.1f}",
        f"{r['dgc_sampled_ms']:.1f}",
    )
    table.add_row(
        "speed-up",
        f"{r['speedup_vs_global_topk']:.1f}x",
        "1.0x",
        f"{r['global_topk_ms'] / r['dgc_sampled_ms']:.1f}x",
    )
    table.add_row(
        "bytes", f"{r['bytes_compressed']:,} (wire)", f"{r['bytes_global_topk']:,} (payload)", ""
    )
    table.add_row(
        "dense fp32 / bytes",
        f"{r['compression_ratio']:.1f}x",
        f"{r['bytes_dense_fp32'] / r['bytes_global_topk']:.1f}x",
        "",
    )
    table.add_row(
        "energy kept",
        f"{r['energy_kept_group_topk']:.3f}",
        f"{r['energy_kept_global_topk']:.3f}",
        "",
    )
    return table


def _ring_table(r: dict[str, Any]) -> Table:
    table = Table(
        title=f"bytes sent per agent (x fewer than dense), {r['numel']:,} entries, "
        f"density {r['density']}, G={r['group_size']}"
    )
    schemes = {
        "dense": "dense fp32",
        "exact": "exact",
        "bounded": "bounded",
        "allgather_dgc": "DGC gather",
    }
    table.add_column("N", justify="right")
    for title in schemes.values():
        table.add_column(title, justify="right")
    for row in r["results"]:
        cells = [
            f"{row[s]['bytes_per_agent']:,.0f} ({row[s]['ratio_vs_dense']:.1f}x)" for s in schemes
        ]
        table.add_row(str(row["agents"]), *cells)
    return table


def bench_quality(
    out: Path = typer.Option(
        Path("runs/quality"),
        "--out",
        help="quality.json (kept across runs), quality.md, quality.png.",
    ),
    regimes: str = typer.Option(
        "all", help="Comma-separated regimes (see fedring.bench.quality.REGIMES) or all."
    ),
    seeds: int = typer.Option(3, min=1, help="Seeds a cell (0..N-1)."),
    frontier: bool = typer.Option(
        False, "--frontier", help="Where auto misses 1 pp or 10x: fixed densities for 5x-50x."
    ),
    attacks: bool = typer.Option(
        False, "--attacks", help="1 of 4 and 2 of 10 agents attack each robust rule."
    ),
) -> None:
    """Accuracy and uplink bytes of each regime x method (dense twin beside), 3 seeds.

    Cells already in OUT/quality.json are not run again; the table and the plot are
    re-made from all of them. Heavy (tens of minutes on 2 cores): not part of the tests.
    """
    from fedring.bench import quality, quality_report

    names = list(quality.REGIMES) if regimes == "all" else [r for r in regimes.split(",") if r]
    unknown = [n for n in names if n not in quality.REGIMES]
    if unknown:
        typer.echo(f"error: unknown regime {unknown[0]!r}; one of {', '.join(quality.REGIMES)}",
                   err=True)  # fmt: skip
        raise typer.Exit(2)
    results = quality.run(out, names, seeds=seeds, frontier=frontier, attacks=attacks,
                          say=lambda line: typer.echo(line, err=True))  # fmt: skip
    quality_report.write(results.rows, out)
    typer.echo(quality_report.markdown(results.rows))

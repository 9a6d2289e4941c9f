"""`fedring bench grid`: time to target over models x links x N x methods, one invocation.

Every cell is (N agents, per-agent bandwidth, added one-way delay, model); every
method runs in it on the same task, shards and initial model, in one `Lab` per N
whose links are re-shaped (`tc qdisc replace`) and whose delay is re-set between
cells rather than rebuilt:

- fedring, group-top-k 1 % + error feedback, sync, ``collective`` = ring | fanout |
  hub | auto (``ring``, ``fanout``, ``hub``, ``auto``), the dense ring (``dense``),
  and ``auto-codec``: ``compression = "auto"`` with ``collective = "auto"``, the codec
  (dense fp32 or group-top-k 1 %) chosen with the collective (`fedring.choose`);
- Flower FedAvg through a SuperLink on the hub (``flower``);
- torch DDP over gloo (``ddp``), and with torch's PowerSGD hook of rank 2 and 4
  (``powersgd2``, ``powersgd4``).

The delay reaches everyone: fedring's agents and Flower's SuperNodes dial the hub
through `fedring.lab.delay` proxies on their own loopback; DDP's ranks talk to each
other directly, so with a delay they run behind `fedring.lab.delayline`, a
user-space packet delay line on every agent link (each packet held ``delay_ms`` in
each direction). A row's ``delay_applied`` says whether its traffic was delayed.

Each run is capped at ``cap_s`` seconds of training: a run that has not reached the
target by then is stopped at its next evaluation and recorded as "> cap" with its
best accuracy. Time to target counts training only, as in `fedring.bench.edge_lab`.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from fedring.bench.lab_grid_cpu import CPU_BOUND, CpuShare
from fedring.bench.lab_grid_methods import METHODS
from fedring.bench.lab_grid_resume import (
    ResumeError,
    done,
    failed,
    record,
    resumed,
    run_key,
    stored,
)
from fedring.config import JobSpec
from fedring.lab.lab import Lab, LabRunError
from fedring.lab.netns import AGENT_IFACE, LabError
from fedring.report.files import atomic_write

TARGETS = {"digits": 0.95, "mnist1d": 0.85}  # the edge-lab bench's targets
EVAL_EVERY = {"digits": 5, "mnist1d": 10}
ROUNDS = 100_000  # a budget the cap always cuts first
ALIASES = {
    "mnist1d-cnn": "mnist1d/cnn",  # the MNIST-1D paper's CNN, 5,210 parameters
    "digits-mlp": "digits/mlp",  # fedring's default digits MLP, 17,226
    "mlp512": "digits/mlp:512x512",  # 301,066
    "mlp1024": "digits/mlp:1024x1024",  # 1,126,410: the "about 1 M" model
}
GROUP_TOPK: dict[str, Any] = {"compression": "group-topk", "density": 0.01}
FEDRING: dict[str, dict[str, Any]] = {
    "ring": {**GROUP_TOPK, "collective": "ring"},
    "fanout": {**GROUP_TOPK, "collective": "fanout"},
    "hub": {**GROUP_TOPK, "collective": "hub"},
    "auto": {**GROUP_TOPK, "collective": "auto"},
    # compression "auto": dense fp32 or group-top-k 1 %, chosen with the collective
    "auto-codec": {"compression": "auto", "density": 0.01, "collective": "auto"},
    "dense": {"compression": "none"},
}


__all__ = ["ResumeError", "run", "stored", "write"]


class GridError(ValueError):
    """A grid option names something the grid cannot run (the message names it)."""


@dataclass(frozen=True)
class Model:
    dataset: str
    model: str
    target: float

    @property
    def key(self) -> str:
        return f"{self.dataset}/{self.model}"

    @property
    def slug(self) -> str:
        return self.key.replace("/", "-").replace(":", "-")


def parse_model(text: str) -> Model:
    """``DATASET/MODEL`` (digits or mnist1d; a model `JobSpec` accepts) or an alias."""
    key = ALIASES.get(text, text)
    dataset, sep, model = key.partition("/")
    if not sep or dataset not in TARGETS or not model:
        raise GridError(f"--model {text!r}: expected DATASET/MODEL with DATASET in "
                        f"{', '.join(TARGETS)}, or one of {', '.join(ALIASES)}")  # fmt: skip
    try:
        JobSpec(dataset=dataset, model=model)
    except (ValueError, TypeError) as exc:
        raise GridError(f"--model {text!r}: {exc}") from None
    return Model(dataset, model, TARGETS[dataset])


def check_methods(methods: Iterable[str]) -> tuple[str, ...]:
    chosen = tuple(methods)
    unknown = [m for m in chosen if m not in METHODS]
    if unknown or not chosen:
        raise GridError(f"--method {unknown or '(none)'}: expected some of {', '.join(METHODS)}")
    return chosen


@cache
def params(model: Model) -> int:
    from fedring.training.datasets import load_dataset
    from fedring.training.models import build_model, param_count

    ds = load_dataset(model.dataset, 0)
    return param_count(build_model(model.model, ds.feature_shape, ds.num_classes, 0))


@dataclass(frozen=True)
class Cell:
    agents: int
    bandwidth_mbps: float
    delay_ms: float
    model: Model

    @property
    def slug(self) -> str:
        return f"n{self.agents}-{self.bandwidth_mbps:g}mbit-{self.delay_ms:g}ms-{self.model.slug}"


@dataclass
class Run:
    """One method in one cell."""

    agents: int
    bandwidth_mbps: float
    delay_ms: float
    model: str
    params: int
    method: str
    target: float
    cap_s: float
    seconds_to_target: float | None = None
    best_accuracy: float = 0.0
    final_accuracy: float = 0.0
    rounds: int = 0
    bytes_sent_per_agent: float = 0.0
    bytes_received_per_agent: float = 0.0
    wall_seconds: float = 0.0
    delay_applied: bool = True
    collective: str = ""  # auto: the algorithm the coordinator chose
    round_ms: float | None = None  # fedring's: median wall ms from one round's row to the next
    error: str = ""
    # the agents' CPU seconds / (wall x cores), and the whole machine's busy fraction
    # (`lab_grid_cpu`): a run with agents_cpu_share >= CPU_BOUND is CPU-bound
    agents_cpu_share: float | None = None
    machine_cpu_busy: float | None = None
    curve: list[tuple[float, float]] = field(default_factory=list)  # (seconds, accuracy)


def _run(cell: Cell, method: str, cap_s: float) -> Run:
    return Run(cell.agents, cell.bandwidth_mbps, cell.delay_ms, cell.model.key,
               params(cell.model), method, cell.model.target, cap_s)  # fmt: skip


def _score(run: Run, points: list[tuple[float, float]]) -> Run:
    run.curve = points
    accs = [a for _, a in points]
    run.best_accuracy = max(accs, default=0.0)
    run.final_accuracy = accs[-1] if accs else 0.0
    run.seconds_to_target = next((t for t, a in points if a >= run.target), None)
    return run


def fedring_run(lab: Lab, cell: Cell, method: str, cap_s: float, seed: int, out: Path,
                timeout_s: float) -> tuple[Run, bool]:  # fmt: skip
    """A fedring job; the row and whether it was capped (the agents need a restart)."""
    run = _run(cell, method, cap_s)
    fields = dict(FEDRING[method])
    known = {k: v for k, v in fields.items() if k != "collective"}
    spec = JobSpec(agents=cell.agents, dataset=cell.model.dataset, model=cell.model.model,
                   rounds=ROUNDS, eval_every=EVAL_EVERY[cell.model.dataset],
                   target_accuracy=cell.model.target, seed=seed, checkpoint_every=ROUNDS,
                   timeout_s=60.0, **known)  # fmt: skip
    try:
        spec = spec.replace(**fields)
        fields = {}
    except ValueError:  # a collective newer than this process's code: the coordinator checks it
        fields = {"collective": fields["collective"]}
    start = time.monotonic()
    result = lab.run_job(spec, name=f"{cell.slug}/{method}", timeout_s=timeout_s, cap_s=cap_s,
                         fields=fields)  # fmt: skip
    run.wall_seconds = time.monotonic() - start
    rows = result["rows"]
    _score(run, [(float(r["wall_s"]), float(r["accuracy"])) for r in rows
                 if "accuracy" in r and "wall_s" in r])  # fmt: skip
    run.rounds = int(result["summary"].get("rounds", 0))
    run.round_ms = round_ms(rows)
    sent = [b[0] for b in result["link_bytes"].values()]
    received = [b[1] for b in result["link_bytes"].values()]
    run.bytes_sent_per_agent = sum(sent) / len(sent)
    run.bytes_received_per_agent = sum(received) / len(received)
    run.collective = (chosen_collective(result) if method in ("auto", "auto-codec")
                      else FEDRING[method].get("collective", "ring"))  # fmt: skip
    if not result["summary"].get("identical_models", True):
        run.error = "models differ"
    return run, bool(result.get("capped"))


def round_ms(rows: list[dict[str, Any]]) -> float | None:
    """The median wall ms from one round's row to the next: the collective's pace
    without the convergence noise that time to target carries."""
    walls = [float(r["wall_s"]) for r in rows if "wall_s" in r]
    gaps = [b - a for a, b in itertools.pairwise(walls)]
    return round(statistics.median(gaps) * 1e3, 3) if gaps else None


def fill_round_ms(doc: dict[str, Any], out: Path) -> dict[str, Any]:
    """`doc` with every fedring run's `round_ms`, read from its job's ``metrics.jsonl``
    under `out` where a grid run before that field left it out."""
    for r in doc["runs"]:
        if r["method"] not in FEDRING or r.get("round_ms") is not None:
            continue
        slug = Cell(r["agents"], r["bandwidth_mbps"], r["delay_ms"],
                    parse_model(r["model"])).slug  # fmt: skip
        path = out / f"n{r['agents']}" / slug / r["method"] / "metrics.jsonl"
        if path.exists():
            r["round_ms"] = round_ms([json.loads(line) for line in path.read_text().splitlines()
                                      if line.strip()])  # fmt: skip
    return doc


def run_rows(out: Path, run: dict[str, Any]) -> list[dict[str, Any]]:
    """A fedring run's metrics rows under `out` (none where it kept none); a line cut
    short (a run killed at the cap) is skipped."""
    slug = Cell(run["agents"], run["bandwidth_mbps"], run["delay_ms"],
                parse_model(run["model"])).slug  # fmt: skip
    path = out / f"n{run['agents']}" / slug / run["method"] / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if isinstance(r, dict)]


def chosen_collective(result: dict[str, Any]) -> str:
    """The algorithms `collective = "auto"` ran, in order ("fanout", "ring→fanout"),
    from the rows' ``collective`` field, with their ``codec`` where it was chosen too
    ("dense ring→fanout"); "?" where no row says."""
    seen: list[str] = []
    for row in result["rows"]:
        value = row.get("collective")
        if isinstance(value, str) and row.get("codec") == "dense":
            value = f"dense {value}"
        if isinstance(value, str) and value != "auto" and (not seen or seen[-1] != value):
            seen.append(value)
    return "→".join(seen) or "?"


def peer_run(lab: Lab, cell: Cell, method: str, cap_s: float, seed: int, out: Path,
             timeout_s: float) -> Run:  # fmt: skip
    """Flower FedAvg, DDP or DDP + PowerSGD on the lab's nodes, with the cell's delay."""
    from fedring.bench.ddp import run_ddp
    from fedring.bench.flower_fedavg import run_flower_fedavg
    from fedring.lab.delayline import packet_delay

    run = _run(cell, method, cap_s)
    where = out / cell.slug / method
    before, start = lab.link_bytes(), time.monotonic()
    task: dict[str, Any] = {"dataset": cell.model.dataset, "model": cell.model.model,
            "target": cell.model.target, "seed": seed, "out": where, "timeout_s": timeout_s,
            "cap_s": cap_s}  # fmt: skip
    if method == "flower":
        try:
            # about a round a second at most: FedAvg's rounds after the cap are empty loop turns
            summary = run_flower_fedavg(cell.agents, lab.launch, lab.host, rounds=int(cap_s) + 5,
                                        reach=lab.reach, **task)  # fmt: skip
        finally:
            lab.stop_proxies()
    else:
        rank = {"ddp": 0, "powersgd2": 2, "powersgd4": 4}[method]
        with packet_delay(lab, where) as applied:
            run.delay_applied = applied
            summary = run_ddp(cell.agents, lab.launch, lab.host, rounds=ROUNDS,
                              eval_every=EVAL_EVERY[cell.model.dataset], iface=AGENT_IFACE,
                              powersgd_rank=rank, **task)  # fmt: skip
    run.wall_seconds = time.monotonic() - start
    after = lab.link_bytes()
    run.bytes_sent_per_agent = sum(after[n][0] - before[n][0] for n in after) / len(after)
    run.bytes_received_per_agent = sum(after[n][1] - before[n][1] for n in after) / len(after)
    _score(run, [(float(m["t"]), float(m["accuracy"])) for m in summary["metrics"]
                 if m["round"] > 0])  # fmt: skip
    run.rounds = int(summary["rounds"])
    return run


Measure = Callable[[Any, Cell, str], tuple[Run, bool]]  # (lab, cell, method): run, capped


def run(
    models: tuple[Model, ...],
    bandwidths: tuple[float, ...],
    delays: tuple[float, ...],
    agents: tuple[int, ...],
    methods: tuple[str, ...],
    *,
    cap_s: float = 60.0,
    budget_s: float | None = None,
    seed: int = 0,
    out: Path = Path("runs/lab-grid"),
    timeout_s: float = 600.0,
    on_run: Callable[[Run], None] | None = None,
    resume: bool = False,
    open_lab: Callable[[int, float, Path], AbstractContextManager[Any]] | None = None,
    measure: Measure | None = None,
) -> dict[str, Any]:
    """Every method in every cell, in the order N, bandwidth, delay, model (the last
    varies fastest). ``grid.json``, ``grid.md`` and ``grid.png`` are rewritten after
    every run. With `budget_s`, no cell starts after that many seconds: the ones left
    are listed in ``not_run``. With `resume`, the runs already in ``out/grid.json`` are
    kept and only the missing ones run, over the union of its axes and these
    (`lab_grid_resume`). `open_lab` and `measure` stand in for `Lab` and the methods'
    runners (a test's)."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    fresh: dict[str, Any] = {
        "cap_s": cap_s, "budget_s": budget_s, "seed": seed, "models": [m.key for m in models],
        "bandwidths_mbps": list(bandwidths), "delays_ms": list(delays), "agents": list(agents),
        "methods": list(methods), "bench_seconds": 0.0, "runs": [], "not_run": [],
        "invocations": 1, "cpu_bound_share": CPU_BOUND,
    }  # fmt: skip
    doc = resumed(out, fresh) if resume else fresh
    doc["not_run"], spent, have = [], float(doc["bench_seconds"]), done(doc)
    if resume:  # a failed run is run again only where this invocation names its method
        have |= {run_key(r) for r in doc["runs"] if failed(r) and r["method"] not in methods}
    lab_of = open_lab or (lambda n, bw, where: Lab(n, bw, workdir=where))
    one = measure or (lambda lab, cell, m: _measure(lab, cell, m, cap_s, seed, timeout_s))
    wanted = tuple(m for m in doc["methods"] if m in METHODS)
    models = tuple(parse_model(m) for m in doc["models"])

    def over() -> bool:
        return budget_s is not None and time.monotonic() - start >= budget_s

    def save(draw: bool = True) -> None:
        doc["bench_seconds"] = spent + time.monotonic() - start
        write(doc, out, draw)

    for n in doc["agents"]:
        todo = [(c, [m for m in wanted if (*cell_key(c), m) not in have])
                for c in (Cell(n, bw, d, m) for bw in doc["bandwidths_mbps"]
                          for d in doc["delays_ms"] for m in models)]  # fmt: skip
        todo = [(c, missing) for c, missing in todo if missing]
        if todo and over():
            doc["not_run"] += [asdict(c) for c, _ in todo]
        if not todo or over():
            continue
        with lab_of(n, doc["bandwidths_mbps"][0], out / f"n{n}") as lab:
            for cell, missing in todo:
                if over():
                    doc["not_run"].append(asdict(cell))
                    continue
                lab.reshape(cell.bandwidth_mbps)
                lab.set_delay(cell.delay_ms)
                for found in _cell(lab, cell, missing, one, cap_s):
                    record(doc, asdict(found))
                    save(draw=False)  # each run kept as it ends: a cut-short grid loses nothing
                    _tell(on_run, found)
                save()  # and the plot once a cell
    save()
    return doc


def cell_key(cell: Cell) -> tuple[int, float, float, str]:
    return (cell.agents, float(cell.bandwidth_mbps), float(cell.delay_ms), cell.model.key)


def keep_digests(doc: dict[str, Any], out: Path) -> None:
    """Put in each fedring run's record what the verdict reads of its rows under `out`
    (``rows_digest``): a ``grid.json`` without its run folders keeps its verdict."""
    from fedring.bench.lab_grid_verdict import FEDRING_RUNS, facts

    for run in doc["runs"]:
        if run["method"] in FEDRING_RUNS and (rows := run_rows(out, run)):
            run["rows_digest"] = facts(run, rows)


def write(doc: dict[str, Any], out: Path, draw: bool = True) -> dict[str, Any]:
    """``grid.json``, ``grid.md`` (the tables) and, with `draw`, ``grid.png`` (the plot)
    in `out`."""
    from fedring.bench.lab_grid_report import plot, tables
    from fedring.bench.lab_grid_verdict import verdict

    keep_digests(doc, out)
    atomic_write(out / "grid.json", json.dumps(doc, indent=1))
    judged = any(r["method"] == "auto-codec" for r in doc["runs"])
    head = "\n\n`auto` choosing codec and collective against the rest (issue 29's bars):\n\n"
    said = verdict(doc, lambda run: run_rows(out, run)) if judged else ""
    atomic_write(out / "grid.md", tables(doc) + (head + said if judged else "") + "\n")
    if doc["runs"] and draw:
        doc["plot"] = str(plot(doc, out / "grid.png"))
    return doc


def _measure(lab: Lab, cell: Cell, method: str, cap_s: float, seed: int,
             timeout_s: float) -> tuple[Run, bool]:  # fmt: skip
    if method in FEDRING:
        return fedring_run(lab, cell, method, cap_s, seed, lab.workdir, timeout_s)
    return peer_run(lab, cell, method, cap_s, seed, lab.workdir, timeout_s), False


def _agent_pids(lab: Any) -> list[int]:
    """The processes on the agents' nodes (daemons, proxies, SuperNodes, DDP ranks)."""
    return [p.pid for name, p in getattr(lab, "procs", []) if not name.startswith("hub:")
            and p.poll() is None]  # fmt: skip


def _cell(lab: Any, cell: Cell, methods: list[str], one: Measure,
          cap_s: float) -> Iterator[Run]:  # fmt: skip
    """Each of `methods` in `cell`: the peers before the agent daemons start, then
    fedring's on one set of daemons (restarted after a capped or failed job, which may
    still hold them), each with the agents' CPU share (`lab_grid_cpu`)."""
    peers = [m for m in methods if m not in FEDRING]
    mine = [m for m in methods if m in FEDRING]
    for method in peers:
        yield _timed(lab, cell, method, cap_s, one)[0]
    if not mine:
        return
    lab.start_agents()
    try:
        for method in mine:
            found, cut = _timed(lab, cell, method, cap_s, one)
            if cut or found.error:
                lab.stop_agents()
                lab.start_agents()
            yield found
    finally:
        lab.stop_agents()


def _timed(lab: Any, cell: Cell, method: str, cap_s: float, one: Measure) -> tuple[Run, bool]:
    capped: list[bool] = []

    def runner() -> Run:
        found, cut = one(lab, cell, method)
        capped.append(cut)
        return found

    with CpuShare(lambda: _agent_pids(lab)) as cpu:
        found = _guarded(cell, method, cap_s, runner)
    found.agents_cpu_share, found.machine_cpu_busy = cpu.share, cpu.machine
    return found, any(capped)


def _guarded(cell: Cell, method: str, cap_s: float, runner: Callable[[], Run]) -> Run:
    """The run, or a row that names the failure: one failed method never sinks the grid."""
    from fedring.bench.launch import BaselineError

    try:
        return runner()
    except (BaselineError, LabRunError, LabError, OSError, ValueError, KeyError) as exc:
        failed = _run(cell, method, cap_s)
        failed.error = f"{type(exc).__name__}: {str(exc)[-300:]}"
        return failed


def _tell(on_run: Callable[[Run], None] | None, run: Run) -> None:
    if on_run is not None:
        on_run(run)

"""`fedring bench quality`: what compression costs in accuracy, regime by regime, and in bytes.

Each regime is a job users run; each method a way to send its updates; each cell
runs 3 seeds (the split, the shards, the initial model and the batches) and keeps
the final accuracy and the uplink bytes an agent sent. The dense twin (fp32, no
compression) runs beside every compressed method with the same seed. Methods:

- ``dense``: the plain fp32 exchange (FedAvg's dense uplinks under Flower);
- ``auto``: fedring's default, ``density = "auto"`` (`compression.policy`);
- ``1%``: a fixed density of 1% with the DGC warm-up (the default before auto);
- a rule's name (``median``, ``trimmed:0.25``, ...): that aggregation under auto.

Where auto is not within 1 pp of dense with at least 10x fewer bytes, the frontier
(``--frontier``) runs fixed densities sized for 5x, 10x, 20x and 50x fewer bytes.
Attacks (``--attacks``): f agents of N poison what they send (`engine.attack`), and
each rule's accuracy is set beside the attack-free mean.

Results accumulate in ``OUT/quality.json`` (a cell already there is not run again),
and every invocation re-makes ``OUT/quality.md`` and ``OUT/quality.png`` from all of
them (`bench.quality_report`).

    fedring bench quality --out runs/quality [--regimes fedavg-h1,star] [--seeds 3]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedring.compression.policy import cap_for

SEEDS = 3
FRONTIER = (5.0, 10.0, 20.0, 50.0)  # x fewer bytes than dense
FIXED = {"density": 0.01, "density_warmup": 10}  # the default before density auto
ATTACKS = ("sign-flip", "scale:-10", "noise", "label-flip")
Run = Callable[[dict[str, Any], int], dict[str, float]]  # (method's fields, seed) -> result


@dataclass(frozen=True)
class Regime:
    """A job users run, and the methods compared on it."""

    name: str
    title: str
    base: dict[str, Any]  # JobSpec fields (simulate) or the Flower app's settings
    methods: dict[str, dict[str, Any]]  # method -> fields over `base`
    runner: str = "simulate"  # simulate | flower
    dense: dict[str, Any] = field(default_factory=lambda: {"compression": "none"})


def _star(**extra: Any) -> dict[str, Any]:
    return {"agents": 50, "topology": "star", "sample": 10, "sync": "local", "rounds": 40,
            "dataset": "digits", **extra}  # fmt: skip


SYNC = {"agents": 4, "dataset": "digits", "sync": "sync", "rounds": 300}
STANDARD = {"auto": {}, "1%": FIXED}
REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime("fedavg-h1", "FedAvg, 1 local step, 40 rounds, 10 of 50 (simulate)",
               _star(local_steps=1), STANDARD),
        Regime("fedavg-h12", "FedAvg, 12 local steps, 40 rounds, 10 of 50 (simulate)",
               _star(local_steps=12), STANDARD),
        Regime("flower-h1", "Flower FedAvg app + group_topk_mod, 1 local step, 40 rounds, "
               "10 of 50", {"local_steps": 1}, {"auto": {}},
               runner="flower", dense={"plain": True}),
        Regime("flower-h12", "Flower FedAvg app + group_topk_mod, 12 local steps, 40 rounds, "
               "10 of 50", {"local_steps": 12}, {"auto": {}},
               runner="flower", dense={"plain": True}),
        Regime("local-h1", "local SGD, 1 step a round, 40 rounds, 4 agents", {
            "agents": 4, "dataset": "digits", "sync": "local", "local_steps": 1,
            "rounds": 40}, STANDARD),
        Regime("sync-sgd", "sync SGD every step, digits MLP, 300 rounds, 4 agents", SYNC,
               STANDARD),
        Regime("sync-sgd-40", "sync SGD every step, digits MLP, 40 rounds, 4 agents",
               {**SYNC, "rounds": 40}, STANDARD),
        Regime("sync-cnn", "sync SGD every step, MNIST-1D CNN, 600 rounds, 4 agents",
               {**SYNC, "dataset": "mnist1d", "model": "cnn", "rounds": 600}, STANDARD),
        Regime("dirichlet-8", "sync SGD, non-iid Dirichlet 0.3, 8 agents, 300 rounds",
               {**SYNC, "agents": 8, "sharding": "dirichlet:0.3"}, STANDARD),
        *(Regime(f"sync-{opt}-{task}", f"sync, {name}, {title}, 4 agents, library API",
                 {"task": task, "recipe": recipe, "rounds": rounds}, {"auto": {"compressed": True}},
                 runner="library", dense={"compressed": False})
          for task, title, rounds in (("digits", "digits MLP, 300 rounds", 300),
                                      ("mnist1d", "MNIST-1D CNN, 600 rounds", 600))
          for opt, name, recipe in (("momentum", "momentum SGD 0.9", ("SGD momentum 0.9", 0.025)),
                                    ("adamw", "AdamW 6e-3", ("AdamW", 6e-3)))),
        Regime("star", "star, 4 agents, 300 rounds: robust rules under density auto",
               {**SYNC, "topology": "star"},
               {"mean": {}, "median": {"aggregation": "median"},
                "trimmed:0.25": {"aggregation": "trimmed:0.25"}, "clip": {"aggregation": "clip"}}),
    )
}  # fmt: skip


def simulate_cell(fields: dict[str, Any], seed: int) -> dict[str, float]:
    """One in-process job; an ``attack`` field (KIND, attackers) goes to the harness."""
    from fedring.config import JobSpec
    from fedring.engine.attack import Attack
    from fedring.sim.runner import simulate

    fields = dict(fields)
    attack = fields.pop("attack", None)
    attackers = fields.pop("attackers", 0)
    spec = JobSpec.from_mapping({**fields, "seed": seed})
    harness = Attack.parse(attack) if attack else None
    s = simulate(spec, attack=harness, attackers=attackers) if harness else simulate(spec)
    return {"accuracy": s["final_accuracy"], "uplink_bytes": s["bytes_sent_per_agent"],
            "wall_s": s["wall_seconds"], "density": float(spec.density)}  # fmt: skip


def flower_cell(fields: dict[str, Any], seed: int) -> dict[str, float]:
    """examples/flower_app on the simulation engine: 50 nodes, FedAvg samples 10."""
    from fedring.flower.simulation import simulate_apps

    example = Path(__file__).resolve().parents[2] / "examples" / "flower_app"
    variant = "plain" if fields.get("plain") else "compressed"
    env = {"PYTHONPATH": str(example), "FEDRING_FLOWER_ROUNDS": "40",
           "FEDRING_FLOWER_CLIENTS": "50", "FEDRING_FLOWER_FRACTION": "0.2",
           "FEDRING_FLOWER_SEED": str(seed),
           "FEDRING_FLOWER_LOCAL_STEPS": str(fields["local_steps"])}  # fmt: skip
    if "density" in fields:
        env["FEDRING_FLOWER_DENSITY"] = str(fields["density"])
    with tempfile.TemporaryDirectory() as tmp:
        s = simulate_apps(f"flower_app.metered:{variant}_server",
                          f"flower_app.metered:{variant}_client", 50, Path(tmp),
                          timeout_s=1800, env=env)  # fmt: skip
    return {"accuracy": s["final_accuracy"], "uplink_bytes": s["uplink_bytes_per_client"],
            "wall_s": s["wall_seconds"]}  # fmt: skip


def library_cell(fields: dict[str, Any], seed: int) -> dict[str, float]:
    """A user's own loop over the public API with a `torch.optim` optimizer wrapped by
    `DistributedOptimizer` (bench/optimizers.py's agents), 4 agents, sync mode; the
    reducer's density is auto for the rounds when compressed (the update agreement
    for all but plain SGD, `SyncSettings.agree` auto)."""
    import runpy

    from fedring.engine.plan import plan

    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "optimizers.py"))
    recipe = next(r for r in bench["RECIPES"] if (r.name, r.lr) == tuple(fields["recipe"]))
    rounds = int(fields["rounds"])
    task = bench["TASKS"][fields["task"]]
    p = plan(task, agents=bench["AGENTS"], seed=seed)
    way = bench["Way"](compressed=bool(fields["compressed"]), agree="auto", density="auto")
    got = bench["train"](p, recipe, way, rounds, seed)
    return {"accuracy": got.accuracy, "uplink_bytes": got.bytes_per_agent, "wall_s": 0.0}


RUNNERS: dict[str, Run] = {
    "simulate": simulate_cell, "flower": flower_cell, "library": library_cell,
}  # fmt: skip


class Results:
    """The cells run so far, kept in ``OUT/quality.json`` after each one."""

    def __init__(self, out: Path) -> None:
        self.path = out / "quality.json"
        out.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = (
            json.loads(self.path.read_text())["rows"] if self.path.exists() else []
        )

    def find(self, table: str, regime: str, method: str, seed: int) -> dict[str, Any] | None:
        for row in self.rows:
            if (row["table"], row["regime"], row["method"], row["seed"]) == (
                table, regime, method, seed,
            ):  # fmt: skip
                return row
        return None

    def run(self, table: str, regime: Regime, method: str, fields: dict[str, Any],
            seed: int, say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
        got = self.find(table, regime.name, method, seed)
        if got is not None:
            return got
        start = time.perf_counter()
        result = RUNNERS[regime.runner]({**regime.base, **fields}, seed)
        row = {"table": table, "regime": regime.name, "title": regime.title,
               "method": method, "seed": seed, "fields": fields, **result}  # fmt: skip
        self.rows.append(row)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": self.rows}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)  # nothing lost if the run is cut short
        say(f"{table:9s} {regime.name:12s} {method:14s} seed {seed}: accuracy "
            f"{result['accuracy']:.4f}, {result['uplink_bytes']:,.0f} B "
            f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
        return row


def frontier_density(saving: float) -> float:
    """The fixed density that sends about `saving` x fewer bytes than dense."""
    return round(max(0.004, cap_for(saving)), 4)


def run(out: Path, regimes: Iterable[str], seeds: int = SEEDS, frontier: bool = False,
        attacks: bool = False, say: Callable[[str], None] = print) -> Results:  # fmt: skip
    """Run every missing cell of `regimes` (and the frontier, the attacks) into `out`."""
    results = Results(out)
    for name in regimes:
        regime = REGIMES[name]
        for seed in range(seeds):
            results.run("main", regime, "dense", regime.dense, seed, say)
            for method, fields in regime.methods.items():
                results.run("main", regime, method, fields, seed, say)
        if frontier and _short_of_goal(results, regime, seeds):
            for saving in FRONTIER:
                fields = {"density": frontier_density(saving), "density_warmup": 0}
                for seed in range(seeds):
                    results.run("frontier", regime, f"{saving:g}x", fields, seed, say)
    if attacks:
        for agents, bad in ((4, 1), (10, 2)):
            regime = Regime(f"attack-{bad}of{agents}", f"star, {bad} of {agents} agents attack",
                            {**SYNC, "topology": "star", "agents": agents}, {})  # fmt: skip
            rules = {"mean": {}, **{k: v for k, v in REGIMES["star"].methods.items() if v}}
            for seed in range(seeds):
                results.run("attack", regime, "mean, no attack", {}, seed, say)
                for rule, fields in rules.items():
                    for attack in ATTACKS:
                        cell = {**fields, "attack": attack, "attackers": bad}
                        results.run("attack", regime, f"{rule} / {attack}", cell, seed, say)
    return results


def _short_of_goal(results: Results, regime: Regime, seeds: int) -> bool:
    """Auto is more than 1 pp below dense, or sends less than 10x fewer bytes."""
    pairs = [(results.find("main", regime.name, "auto", s),
              results.find("main", regime.name, "dense", s)) for s in range(seeds)]  # fmt: skip
    got = [(a, d) for a, d in pairs if a is not None and d is not None]
    if not got:
        return False
    gap = sum(d["accuracy"] - a["accuracy"] for a, d in got) / len(got)
    ratio = sum(d["uplink_bytes"] / a["uplink_bytes"] for a, d in got) / len(got)
    return gap > 0.01 or ratio < 10.0

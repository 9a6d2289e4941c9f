"""`fedring simulate`: N agents in one process, real frames over the in-process transport.

The coordinator's part is done here (`engine.plan`: load and shard the data, a
manifest with a sha256 per shard, the initial model's parameters and hash); each
agent then verifies its shard and the initial parameters it is handed before
training, exactly as a board would, and
runs the engine's loop (`engine.loop.run`; a star's centre, `engine.centre`, on a
thread of its own; the async star is `sim.async_star`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fedring import build
from fedring.build import plan, prepare_model
from fedring.choose import choose_collective, in_process_probes
from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.collective.torus import layout_name
from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.engine.attack import Attack
from fedring.engine.centre import STAR, serve
from fedring.engine.group import LOCAL_KEY, local_group
from fedring.engine.loop import LoopResult, run
from fedring.engine.plan import Plan
from fedring.engine.resync import Drift
from fedring.engine.resync import summarise as summarise_drift
from fedring.firmware_profiles.schema import Profile
from fedring.sim.shared_eval import SharedEvaluation, shareable
from fedring.training.datasets import Dataset
from fedring.training.models import param_count, params_sha256, pay_process_one_offs
from fedring.transport.inproc import InprocTransport

TIMES = ("compute_s", "comm_s", "step_s")  # a sync round's seconds, in every row
# A test's stand-in for another CPU architecture: called with (rank, round, model)
# before each round, it may nudge that member's parameters (`engine.resync`).
Perturb = Callable[[int, int, torch.nn.Module], None]


def simulate(
    spec: JobSpec,
    on_round: Callable[[int, dict[str, Any]], None] | None = None,
    on_done: Callable[[torch.nn.Module, Dataset], None] | None = None,
    fleet: list[Profile] | None = None,
    perturb: Perturb | None = None,
    attack: Attack | None = None,
    attackers: int | Sequence[int] = 1,
) -> dict[str, Any]:
    """Run the job; return a summary (see `summarise`) with per-round rows.

    `on_done` receives agent 0's trained model and the dataset (e.g. to export ONNX).
    With ``pipeline_stages`` > 1 the agents form an S x D grid (`sim.pipeline`), whose
    stages fit the budgets of the `fleet`'s boards (one profile per agent).
    `perturb` stands in for members on other CPU architectures (tests of the re-sync).
    `attack` is a test harness for robust aggregation (`engine.attack`, never on by
    default): the last `attackers` ranks (or those ranks, given as a list) send
    poisoned updates; the summary's ``attack`` says which and how many.
    """
    ranks = _attackers(spec, attack, attackers)
    if spec.pipeline_stages > 1:
        from fedring.sim.pipeline import simulate_pipeline

        return simulate_pipeline(spec, on_round, on_done, fleet)
    if spec.sync == "async":
        from fedring.sim.async_star import simulate_async

        return simulate_async(spec, plan(spec), on_round, on_done)
    begin = time.perf_counter()
    p = plan(spec)
    choice = None
    if spec.collective == "auto":  # planned like the coordinator's, from in-process probes
        choice = choose_collective(spec, p.initial.numel(), in_process_probes(spec.agents))
        spec = spec.replace(collective=choice.algorithm)
    pay_process_one_offs()
    start = time.perf_counter()  # the run's clock: what is above is `setup_seconds`
    prepared = [prepare_model(spec, p, r) for r in range(spec.agents)]
    torch.set_num_threads(1)  # N agent threads on a small machine: no intra-op oversubscription
    hub, counters = InprocTransport(cooperative=True), Counters()
    baton = hub.baton
    groups = local_group(spec.agents, job="sim", topology=spec.topology,
                         timeout_s=spec.timeout_s, hub=hub, counters=counters,
                         algorithm=spec.collective)  # fmt: skip
    members = [
        build.member(spec, p.task, p.dataset, *prepared[r], groups[r], rank=r,
                     weight=p.weights[r], yielder=baton,
                     on_round=on_round if r == 0 else None,
                     attack=attack if r in ranks else None, counters=counters)
        for r in range(spec.agents)
    ]
    if shareable(p.task):  # sync members hold equal parameters: one evaluation, not N
        evaluate = SharedEvaluation(members[0].evaluate)
        for m in members:
            m.evaluate = evaluate
    if perturb is not None:
        for r, m in enumerate(members):
            m.before_round = lambda rnd, r=r, model=m.state.model: perturb(r, rnd, model)
    loop = build.loop_settings(spec)
    numel = param_count(prepared[0][0])

    def agent(rank: int) -> LoopResult:
        try:
            with baton.turn() if baton else contextlib.nullcontext():
                return run(members[rank], loop)
        finally:
            # Leave, done or failed: neighbours waiting on this agent fail fast, and a
            # star's centre sees a job that stopped at its target end, not time out.
            # Whatever this agent sent is queued ahead of its leaving.
            groups[rank].channel.endpoint.close()
            members[rank].state.optimizer.close()

    def centre(channel: PeerChannel) -> int:
        try:
            return serve(channel, groups[0].members, numel, build.centre_settings(spec))
        finally:
            channel.endpoint.close()  # members still waiting for a reply stop at once

    with ThreadPoolExecutor(max_workers=spec.agents + 1) as pool:
        server = None
        if build.needs_centre(spec):
            channel = PeerChannel(hub.connect(STAR), "sim", key=LOCAL_KEY, counters=counters)
            server = pool.submit(centre, channel)
        futures = [pool.submit(agent, r) for r in range(spec.agents)]
        results = _gather(futures, server)
    channels = [g.channel for g in groups]
    models = [m.state.model for m in members]
    summary = summarise(spec, p, results, models, channels, time.perf_counter() - start)
    summary["setup_seconds"] = start - begin
    summary["counters"] = counters.snapshot()
    if attack is not None:
        summary["attack"] = {**attack.to_dict(), "attackers": ranks,
                             "attack_updates": counters.get("attack_updates")}  # fmt: skip
    if choice is not None:
        summary["collective"] = [{"epoch": 0, "members": spec.agents, **choice.to_dict()}]
    if on_done is not None:
        on_done(models[0], p.dataset)
    return summary


def _attackers(spec: JobSpec, attack: Attack | None, attackers: int | Sequence[int]) -> list[int]:
    """The attacking ranks: the last `attackers` of the job's, or the ranks listed (none
    without an attack)."""
    if attack is None:
        return []
    if spec.pipeline_stages > 1 or spec.sync == "async":
        raise ValueError(
            f"attack {str(attack)!r}: simulate attacks sync, local and adaptive jobs, "
            f"not {'a pipeline' if spec.pipeline_stages > 1 else 'sync = async'}"
        )
    if not isinstance(attackers, int):
        ranks = sorted(set(attackers))
        if not ranks or not all(type(r) is int and 0 <= r < spec.agents for r in ranks):
            raise ValueError(f"attackers={attackers!r}: expected ranks 0 to {spec.agents - 1}")
        return ranks
    if isinstance(attackers, bool) or not 1 <= attackers <= spec.agents:
        raise ValueError(f"attackers={attackers!r}: expected 1 to agents={spec.agents}")
    return list(range(spec.agents - attackers, spec.agents))


def _gather(agents: list[Any], centre: Any | None = None) -> list[Any]:
    """The agents' results, or the error that stopped the job, as itself: a bug
    (anything but a `CollectiveError`) before the failed exchanges it caused, and
    the centre's failure before the agents' loss of it."""
    errors = [f.exception() for f in ([centre] if centre is not None else []) + agents]
    causes = [e for e in errors if e is not None and not isinstance(e, CollectiveError)]
    first = causes or [e for e in errors if e is not None]
    if first:
        raise first[0]
    return [f.result() for f in agents]


def summarise(
    spec: JobSpec, p: Plan, results: list[LoopResult], models: list[Any],
    channels: list[PeerChannel], wall: float,
) -> dict[str, Any]:  # fmt: skip
    """The `--json` object: accuracy, rounds, bytes, hashes, and per-round rows."""
    evals = [r.evals for r in results]
    final = [e[-1]["accuracy"] for e in evals if e]
    hashes = sorted({params_sha256(m) for m in models})
    sent = [ch.endpoint.stats.bytes_sent for ch in channels]
    numel = param_count(models[0])
    rows = [_mean_row([res.rows[i] for res in results]) for i in range(results[0].rounds_run)]
    drifts = _drifts(results)
    return {
        "final_accuracy": sum(final) / len(final) if final else 0.0,
        "rounds": results[0].rounds_run,
        "bytes_sent_per_agent": sum(sent) / len(sent),
        "frames_sent_per_agent": sum(ch.endpoint.stats.frames_sent for ch in channels) / len(sent),
        "dense_equivalent_bytes": _dense_equivalent(spec, numel, results[0].rounds_run),
        "wall_seconds": wall,
        "params": numel,
        "layout": (
            "star" if spec.topology == "star"
            else layout_name(spec.topology, spec.agents) if spec.collective == "ring"
            else f"{spec.collective} of {spec.agents}"
        ),
        "model_hashes": hashes,
        "identical_models": len(hashes) == 1,
        "rollbacks": results[0].rollbacks,
        "evals": evals[0],
        "rows": rows,
        "round_seconds": _mean_times(rows),
        "manifest": p.manifest.to_dict(),
        "model_sha256_initial": p.model_sha256,
        "drift": summarise_drift(drifts, spec.resync_every if drifts else 0),
        "codec": spec.codec_choice(),
    }


def _drifts(results: list[LoopResult]) -> list[tuple[str, int, Drift]]:
    """Every member's drift from the head before each re-sync."""
    return [
        (f"agent-{rank}", row["round"], Drift(row["drift_max_abs"], row["drift_l2"]))
        for rank, res in enumerate(results) for row in res.rows if row.get("resynced")
    ]  # fmt: skip


def _dense_equivalent(spec: JobSpec, numel: int, rounds: int) -> float:
    """Bytes per agent a dense fp32 ring would send for the same rounds (payload only)."""
    n = spec.agents
    return 2 * (n - 1) / n * numel * 4 * rounds if n > 1 else 0.0


def _mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The members' mean; with client sampling, the training figures are the sample's."""
    trained = [r for r in rows if not r.get("sat_out")] or rows
    out = {k: v for k, v in trained[0].items() if k != "sat_out"}
    for key in ("loss", "grad_norm", "compression_error", "residual_norm", *TIMES):
        if key in out:
            out[key] = sum(r[key] for r in trained) / len(trained)
    out["bytes_sent"] = sum(r["bytes_sent"] for r in rows) / len(rows)
    if len(trained) < len(rows):
        out["trained"] = len(trained)
    return out


def _mean_times(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per round of compute, communication and the whole step (sync mode)."""
    timed = [r for r in rows if "step_s" in r]
    return {k: sum(r[k] for r in timed) / len(timed) for k in TIMES} if timed else {}

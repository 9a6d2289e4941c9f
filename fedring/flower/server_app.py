"""fedring's Flower ServerApp: enrol the nodes, then run star rounds (or the relayed ring).

`make_server_app(job)` builds a ServerApp for a given `FlowerJob` (what `fedring
flower simulate` uses); the module-level `app` reads the job from the run config
(``flwr run . --run-config "agents=2 rounds=5 ..."``; keys are JobSpec fields plus
``downlink``, ``round_timeout_s``, ``enrol_timeout_s`` and ``out``, a directory for summary.json).

A round: one train message per enrolled node, carrying the last downlink (a delta
for nodes that applied every previous one, the whole model for a node that
missed one) and the sha256 the node's model must have after applying it. The
replies that arrive before the round's deadline are aggregated; a node that fails
or stays silent is recorded in the summary's `failures` and gets the whole model
next time. A round with no reply at all ends the run as failed, never a hang.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedring.build import plan
from fedring.compression.payload import Payload
from fedring.config import JobSpec
from fedring.engine.participation import sampled
from fedring.engine.plan import Plan
from fedring.flower import carrier
from fedring.flower.client_app import SERVER, node_name
from fedring.flower.job import FlowerJob, initial_bytes, job_from_run_config, spec_to_config
from fedring.flower.metering import MeteredGrid
from fedring.flower.ring_job import RoundsOutcome, ring_rounds
from fedring.flower.star import GlobalModel

Summary = dict[str, Any]


class RunFailed(RuntimeError):
    """The run could not go on: too few nodes enrolled, or a round without any reply."""


def wait_for_nodes(grid: Grid, n: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= n:
            return nodes
        if time.monotonic() >= deadline:
            raise RunFailed(f"only {len(nodes)} of {n} nodes connected within {timeout_s:.0f} s")
        time.sleep(0.5)


def enrol_content(spec: JobSpec, p: Plan) -> RecordDict:
    """The enrol message's content, the same for every node: the job, the initial
    model's sha256 and the shard table's, and (``init = "sent"``) the initial model.

    The shard table is named by its sha256, not sent: a node shards the data itself
    and checks its table's hash, so the message is the same size at any N."""
    plan_cfg = ConfigRecord({"table_sha256": p.manifest.sha256(), "model_sha256": p.model_sha256})
    content = RecordDict({"job": ConfigRecord(spec_to_config(spec)), "plan": plan_cfg})
    if spec.init == "sent":  # SEEDS A: the start is sent, so every architecture holds its bits
        content["initial"] = ConfigRecord({"params": initial_bytes(p.initial)})
    return content


def enrol(
    grid: Grid, spec: JobSpec, p: Plan, nodes: list[int], timeout_s: float
) -> dict[int, int]:  # fmt: skip
    """Send every node the job, the plan and the initial parameters; return node id ->
    rank of those that agree. `RunFailed` names every node that refused or stayed silent."""
    content = enrol_content(spec, p)
    msgs = [Message(content, dst_node_id=n, message_type=f"{MessageType.QUERY}.enrol")
            for n in nodes]  # fmt: skip
    ranks: dict[int, int] = {}
    problems: list[str] = []
    replies = list(grid.send_and_receive(msgs, timeout=timeout_s))
    for reply in replies:
        node = reply.metadata.src_node_id
        if reply.has_error():
            problems.append(f"node {node}: {reply.error.reason}")
            continue
        rank = int(reply.content.config_records["enrol"]["rank"])  # type: ignore[arg-type]
        if rank in ranks.values():
            problems.append(f"node {node}: partition-id {rank} is taken by another node")
            continue
        ranks[node] = rank
    if len(ranks) < spec.agents:
        replied = {r.metadata.src_node_id for r in replies}
        silent = [n for n in nodes if n not in replied]
        if silent:
            problems.append(f"node{'s' if len(silent) > 1 else ''} "
                            f"{', '.join(map(str, silent))}: no reply within the "
                            f"{timeout_s:g} s enrolment deadline")  # fmt: skip
        raise RunFailed(f"{len(ranks)} of {spec.agents} nodes enrolled: " + "; ".join(problems))
    return ranks


def train_message(node: int, rank: int, r: int, model: GlobalModel, delta: Payload | None,
                  in_sync: bool, message_type: str = MessageType.TRAIN) -> Message:  # fmt: skip
    """Round r's message for one node: its downlink, the model hash, the learning rate."""
    cfg: dict[str, Any] = {"round": r, "lr": model.lr(r), "model_sha256": model.sha256}
    if r == 0 and in_sync:  # every node verified the initial model at enrolment
        cfg.update(kind="none", frames=[])
    elif in_sync and delta is not None:
        cfg.update(kind="delta", frames=carrier.pack(delta, src=SERVER, dst="*", round=r,
                                                     phase="delta"))  # fmt: skip
    else:
        cfg.update(kind="params", frames=carrier.pack(model.whole(), src=SERVER, dst="*", round=r,
                                                      phase="params"))  # fmt: skip
    return Message(RecordDict({"fedring": ConfigRecord(cfg)}), dst_node_id=node,
                   message_type=message_type)  # fmt: skip


def run_job(grid: Grid, job: FlowerJob) -> Summary:
    """The whole job over `grid`; returns the summary (bytes counted on the messages)."""
    start = time.perf_counter()
    spec = job.spec
    metered = MeteredGrid(grid)
    p = plan(spec)
    model = GlobalModel(job, p)
    try:
        nodes = wait_for_nodes(metered, spec.agents, job.enrol_timeout_s)
        ranks = enrol(metered, job.spec, p, nodes, job.enrol_timeout_s)
    except RunFailed as exc:  # a summary all the same: the CLI's --json prints it
        return _not_started(job, str(exc), metered, model.numel, time.perf_counter() - start)
    enrol_bytes = metered.totals()
    if spec.topology == "ring":
        out = ring_rounds(metered, job, ranks, model.numel)
        layout, sha256 = "flower-ring", out.model_sha256
    else:
        out = star_rounds(metered, job, ranks, model)
        layout, sha256 = "flower-star", model.sha256
    final = out.evals[-1]["accuracy"] if out.evals else float("nan")
    return {
        "status": out.status,
        "final_accuracy": final,
        "rounds": len(out.rows),
        "clients": spec.agents,
        "layout": layout,
        **metered.totals(),
        "enrol_uplink_bytes_total": enrol_bytes["uplink_bytes_total"],
        "enrol_downlink_bytes_total": enrol_bytes["downlink_bytes_total"],
        # dense fp32 updates from every node a round trained (the sample, when sampling)
        "dense_equivalent_uplink_bytes_per_client": float(
            model.numel * 4 * sum(r.get("replies", spec.agents) for r in out.rows) / spec.agents
        ),
        "params": model.numel,
        "wall_seconds": time.perf_counter() - start,
        "model_sha256_final": sha256,
        "evals": out.evals,
        "failures": out.failures,
        "rows": out.rows,
    }


def _not_started(job: FlowerJob, reason: str, metered: MeteredGrid, numel: int,
                 wall_s: float) -> Summary:  # fmt: skip
    """The summary of a run that failed before its first round."""
    return {
        "status": f"failed: {reason}", "final_accuracy": float("nan"), "rounds": 0,
        "clients": job.spec.agents, "layout": f"flower-{job.spec.topology}", **metered.totals(),
        "dense_equivalent_uplink_bytes_per_client": 0.0, "params": numel,
        "wall_seconds": wall_s, "evals": [], "failures": [], "rows": [],
    }  # fmt: skip


def star_rounds(
    grid: Grid, job: FlowerJob, ranks: dict[int, int], model: GlobalModel
) -> RoundsOutcome:
    """The star's rounds (the outcome type is shared with the ring's)."""
    spec = job.spec
    out = RoundsOutcome()
    in_sync = set(ranks)
    delta: Payload | None = None
    for r in range(spec.rounds):
        alive = set(grid.get_node_ids())
        chosen = set(sampled(spec.seed, r, spec.agents, spec.sample))  # all, unless sampling
        # a node that sat out gets the whole model (it missed the deltas)
        msgs = [train_message(n, ranks[n], r, model, delta, n in in_sync)
                for n in sorted(ranks) if n in alive and ranks[n] in chosen]  # fmt: skip
        replies = list(grid.send_and_receive(msgs, timeout=job.round_timeout_s))
        updates, losses = _read_replies(replies, ranks, r, model.numel, out.failures)
        replied = {m.metadata.src_node_id for m in replies}
        for m in msgs:
            node = m.metadata.dst_node_id
            if node not in replied:
                out.failures.append({"round": r, "node": node, "rank": ranks[node],
                                     "reason": "no reply before the round's deadline"})  # fmt: skip
        in_sync = {n for n in ranks if ranks[n] in updates}
        if not updates:
            out.status = f"failed: round {r} got no update from any node"
            break
        delta = model.step(r, updates)
        row: dict[str, Any] = {"round": r + 1, "replies": len(updates),
                               "loss": sum(losses) / len(losses)}  # fmt: skip
        if len(chosen) < spec.agents:
            row["sampled"] = sorted(chosen)
        if (r + 1) % spec.eval_every == 0 or r + 1 == spec.rounds:
            test_loss, acc = model.evaluate()
            out.evals.append({"round": r + 1, "test_loss": test_loss, "accuracy": acc})
            row.update(test_loss=test_loss, accuracy=acc)
        out.rows.append(row)
    if model.agg.kind == "hybrid" and out.rows:
        _evaluate_own_models(grid, job, ranks, model, delta, in_sync, out)
    return out


def _evaluate_own_models(
    grid: Grid, job: FlowerJob, ranks: dict[int, int], model: GlobalModel,
    delta: Payload | None, in_sync: set[int], out: RoundsOutcome,
) -> None:  # fmt: skip
    """`hybrid`: every node holds its own model, which only it can test. Send the last
    round's move and take the mean of their accuracies as the run's."""
    r = len(out.rows)
    alive = set(grid.get_node_ids())
    query = f"{MessageType.QUERY}.evaluate"
    msgs = [train_message(n, ranks[n], r, model, delta, n in in_sync, query)
            for n in sorted(ranks) if n in alive]  # fmt: skip
    accs, losses = [], []
    for reply in grid.send_and_receive(msgs, timeout=job.round_timeout_s):
        cfg = None if reply.has_error() else reply.content.config_records["fedring"]
        if cfg is None or cfg.get("status") != "ok":
            out.failures.append({"round": r, "node": reply.metadata.src_node_id,
                                 "reason": "no evaluation of its own model"})  # fmt: skip
            continue
        accs.append(float(cfg["accuracy"]))  # type: ignore[arg-type]
        losses.append(float(cfg["test_loss"]))  # type: ignore[arg-type]
    if accs:
        global_acc = out.evals[-1]["accuracy"] if out.evals else float("nan")
        out.evals.append({"round": r, "test_loss": sum(losses) / len(losses),
                          "accuracy": sum(accs) / len(accs), "own_models": len(accs),
                          "global_accuracy": global_acc})  # fmt: skip


def _read_replies(
    replies: list[Message], ranks: dict[int, int], r: int, numel: int,
    failures: list[dict[str, Any]],
) -> tuple[dict[int, Payload], list[float]]:  # fmt: skip
    """Decoded updates by rank; failed or refused replies go to `failures` (results and
    failures travel apart, so one bad reply never sinks the round)."""
    updates: dict[int, Payload] = {}
    losses: list[float] = []
    for reply in replies:
        node = reply.metadata.src_node_id
        rank = ranks.get(node)
        if rank is None:
            continue
        reason = ""
        if reply.has_error():
            reason = f"error reply: {reply.error.reason!s}"
        else:
            cfg = reply.content.config_records["fedring"]
            if cfg.get("status") != "ok" or cfg.get("round") != r:
                reason = f"{cfg.get('status')!s}: {cfg.get('reason', '')!s}"
            else:
                try:
                    updates[rank] = carrier.unpack(
                        list(cfg["frames"]), src=node_name(rank), dst=SERVER, round=r,  # type: ignore[arg-type]
                        phase="up", numel=numel,
                    )  # fmt: skip
                    losses.append(float(cfg["loss"]))  # type: ignore[arg-type]
                except carrier.CarrierError as exc:
                    reason = f"refused update: {exc}"
        if reason:
            failures.append({"round": r, "node": node, "rank": rank, "reason": reason})
    return updates, losses


def serve(grid: Grid, job: FlowerJob, out: Path | None = None,
          on_summary: Callable[[Summary], None] | None = None) -> Summary:  # fmt: skip
    """Run `job`; write ``out/summary.json``; raise `RunFailed` if it did not complete
    (so the run's status on the SuperLink says so too)."""
    summary = run_job(grid, job)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, sort_keys=True))
    if on_summary is not None:
        on_summary(summary)
    if summary["status"] != "completed":
        raise RunFailed(summary["status"])
    return summary


def make_server_app(job: FlowerJob, on_summary: Callable[[Summary], None] | None = None,
                    out: Path | None = None) -> ServerApp:  # fmt: skip
    """A ServerApp that runs `job` and hands its summary to `on_summary` / `out`."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        serve(grid, job, out, on_summary)

    return server


app = ServerApp()


@app.main()
def _main(grid: Grid, context: Context) -> None:
    job, out = job_from_run_config(dict(context.run_config))
    serve(grid, job, out)

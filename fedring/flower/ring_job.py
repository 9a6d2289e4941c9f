"""The ServerApp's rounds when the job's topology is a ring it relays.

Every round is one relayed ring all-reduce (`ring_relay.relay`) among the enrolled
nodes in rank order. The nodes hold the model: each adds the same reduced bits, so
they end every round with identical parameters, which they prove by reporting a
sha256 (and, every `eval_every` rounds, their test accuracy). The ServerApp only
relays frames and never sees more than the ring's chunks. The nodes train and apply
the sum with the engine's reducer and distributed optimizer (`ring_member`), so the
model is the in-process library's, whatever `torch.optim` optimizer the task brings.

A node that fails before the last step breaks the ring for that round: the round
is retried with the ring re-formed from the survivors (each puts its unsent
update back into its error feedback), and the failure is recorded. A failure in
the last step, when some nodes may already have applied the round, or nodes
that disagree on the model, end the run as failed. Nothing waits past a deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flwr.app import ConfigRecord
from flwr.serverapp import Grid

from fedring.flower.job import FlowerJob
from fedring.flower.ring_relay import RingBroken, relay


@dataclass
class RoundsOutcome:
    """How the rounds went (star or ring): status, per-round rows, evaluations, failures."""

    status: str = "completed"
    rows: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    model_sha256: str = ""


def ring_rounds(grid: Grid, job: FlowerJob, ranks: dict[int, int], numel: int) -> RoundsOutcome:
    spec = job.spec
    order = sorted(ranks.items(), key=lambda pair: pair[1])  # (node, rank) in ring order
    dropped: set[int] = set()
    out = RoundsOutcome()
    for r in range(spec.rounds):
        evaluate = (r + 1) % spec.eval_every == 0 or r + 1 == spec.rounds
        last = None
        while last is None:
            alive = set(grid.get_node_ids())
            ring = [(n, k) for n, k in order if n in alive and n not in dropped]
            if not ring:
                out.status = f"failed: round {r}: no node left in the ring"
                return out
            # Each node sets its own rates (`build.scaling`, per parameter group).
            extra = {n: ConfigRecord({"evaluate": evaluate}) for n, _ in ring}
            try:
                last = relay(grid, ring, r, numel, job.round_timeout_s, spec.policy, extra)
            except RingBroken as exc:
                out.failures.append({"round": r, "node": exc.node, "rank": ranks.get(exc.node),
                                     "step": exc.step, "reason": str(exc)})  # fmt: skip
                if exc.step == 2 * (len(ring) - 1):
                    out.status = f"failed: round {r}: {exc} in the last step"
                    return out
                dropped.add(exc.node)  # re-form the ring from the survivors and retry
        hashes = {str(c["model_sha256"]) for c in last.values()}
        if len(hashes) != 1:
            out.status = f"failed: round {r}: the nodes hold {len(hashes)} different models"
            return out
        out.model_sha256 = hashes.pop()
        first: Any = last[ring[0][0]]
        replies: list[Any] = list(last.values())
        row: dict[str, Any] = {
            "round": r + 1,
            "replies": len(last),
            "loss": sum(float(c["loss"]) for c in replies) / len(last),
        }
        if evaluate:
            ev = {
                "round": r + 1,
                "test_loss": float(first["test_loss"]),
                "accuracy": float(first["accuracy"]),
            }
            out.evals.append(ev)
            row.update(ev)
        out.rows.append(row)
    return out

"""The S x D grid of a pipeline job through the coordinator: who holds what.

``agents`` = S x D daemons: the enrolled agents sorted by id, stage s replica d on
``members[s * D + d]`` (stage s on the D boards s*D .. s*D+D-1, as `fedring simulate`
lays its fleet out). A stage is planned on the slowest speed and the smallest budget
of its D boards. With D > 1 replica d trains on shard d of the job's sharding
(`make_shards` over D, as the in-process grid does), checked by its sha256 on the
board; D = 1 trains on the whole training set, as before. Replica 0 of each stage
uploads the checkpoints and the final state; every replica reports its final
state's sha256, and the replicas of a stage must agree (`replicas_differ`). Each
member's ``bye`` also carries its counters' gain in the job, which reach the summary's
``agent_counters`` once `byes.read_counters` has checked them (a bye is network input).

    >>> grid = Grid(["a0", "a1", "a2", "a3"], stages=2)   # D = 2
    >>> grid.at(1, 0), grid.where("a3")
    ('a2', (1, 1))
    >>> grid.who(3)
    'stage 1 replica 1 (agent a3)'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedring.coordinator.membership import number
from fedring.coordinator.pipeline_files import bubble, stage_rows
from fedring.pipeline.partition import Board, StagePlan
from fedring.training.datasets import Dataset
from fedring.training.sharding import build_manifest, make_shards


@dataclass
class Grid:
    members: list[str]  # stage s replica d -> members[s * D + d]
    stages: int

    @property
    def replicas(self) -> int:
        return len(self.members) // self.stages

    def at(self, stage: int, replica: int) -> str:
        return self.members[stage * self.replicas + replica]

    def where(self, agent: str) -> tuple[int, int]:
        """(stage, replica) of `agent`; (-1, -1) for an agent not in the grid."""
        if agent not in self.members:
            return -1, -1
        return divmod(self.members.index(agent), self.replicas)

    def who(self, index: int) -> str:
        """Member `index` in words: its stage, its replica where D > 1, its agent."""
        s, d = divmod(index, self.replicas)
        replica = f" replica {d}" if self.replicas > 1 else ""
        return f"stage {s}{replica} (agent {self.members[index]})"


@dataclass
class GridJob:
    """A pipeline job's state on the coordinator for one epoch (a re-formation starts
    another)."""

    job: str
    key: bytes
    grid: Grid  # stage s replica d -> agent
    epoch: int = 0
    start: int = 0  # the step this epoch starts from (a checkpoint's after a re-formation)
    acks: set[int] = field(default_factory=set)  # by member index
    done: dict[int, dict[str, Any]] = field(default_factory=dict)  # by member index
    finals: dict[int, torch.Tensor] = field(default_factory=dict)  # by stage (replica 0's)
    stopped: set[str] = field(default_factory=set)  # agents whose stage said nack
    step: int = 0  # the furthest step any stage reported

    @property
    def members(self) -> list[str]:
        return self.grid.members

    def index_of(self, agent: str) -> int:
        return self.members.index(agent) if agent in self.members else -1

    def manifest(self, i: int, spec: dict[str, Any], plan: StagePlan, boards: Sequence[Board],
                 params_sha256: str) -> dict[str, Any]:  # fmt: skip
        """Member `i`'s manifest: its place in the grid, the plan's cut points, the job."""
        s, d = divmod(i, self.grid.replicas)
        return {"mode": "pipeline", "job": self.job, "epoch": self.epoch, "key": self.key.hex(),
                "spec": spec, "stage": s, "replica": d, "replicas": self.grid.replicas,
                "members": self.members,
                "boards": [[b.name, b.gflops, b.budget_mb] for b in boards],
                "starts": [x.start for x in plan.stages], "start_step": self.start,
                "params_sha256": params_sha256}  # fmt: skip


def stage_boards(boards: Sequence[Board], stages: int) -> list[Board]:
    """Stage s's board: the slowest speed and the smallest budget of its D boards."""
    replicas = len(boards) // stages
    out = []
    for s in range(stages):
        own = boards[s * replicas : (s + 1) * replicas]
        if replicas == 1:
            out.append(own[0])
            continue
        names = "+".join(sorted({b.name for b in own}))
        out.append(Board(names, min(b.gflops for b in own), min(b.budget_mb for b in own)))
    return out


def shard_entries(data: Dataset, replicas: int, scheme: str, seed: int) -> list[dict[str, Any]]:
    """Replica d's shard entry (sizes and sha256, the table's sha256); none for D = 1."""
    if replicas == 1:
        return []
    table = build_manifest(data, make_shards(data.y_train.numpy(), replicas, scheme, seed),
                           scheme, seed)  # fmt: skip
    return [table.entry(d).to_dict() for d in range(replicas)]


def replicas_differ(grid: Grid, done: Mapping[int, Mapping[str, Any]]) -> str:
    """Why the replicas of a stage did not end with the same state ('' if they did)."""
    for s in range(grid.stages):
        hashes = {str(done[s * grid.replicas + d].get("sha256")) for d in range(grid.replicas)}
        if len(hashes) > 1:
            agents = [grid.at(s, d) for d in range(grid.replicas)]
            return f"the replicas of stage {s} ({agents}) ended with different states"
    return ""


def grid_summary(grid: Grid, plan: StagePlan, done: Mapping[int, Mapping[str, Any]],
                 runtime_mb: float) -> dict[str, Any]:  # fmt: skip
    """The summary's fields on the grid, from every member's ``bye`` (stage rows and the
    bubble from replica 0's; bytes a mean over every member; each member's counters,
    checked on arrival, under ``agent_counters`` as a data-parallel job's summary)."""
    s_count, d_count = grid.stages, grid.replicas
    firsts = {s: done[s * d_count] for s in range(s_count)}
    return {
        "layout": f"pipeline {s_count} stages x {d_count} replicas", "members": grid.members,
        "plan": plan.to_dict(), "plan_text": plan.describe(),
        "grid": [[grid.at(s, d) for d in range(d_count)] for s in range(s_count)],
        "replica_sha256": [[done[s * d_count + d].get("sha256") for d in range(d_count)]
                           for s in range(s_count)],
        "stages": stage_rows(plan, [grid.at(s, 0) for s in range(s_count)], firsts, runtime_mb),
        "runtime_allowance_mb": runtime_mb,
        "rounds": max(int(number(d.get("steps"))) for d in done.values()),
        "final_loss": firsts[s_count - 1].get("final_loss"),
        "bubble_fraction": bubble(plan, firsts),
        "bytes_sent_per_agent": sum(number(d.get("bytes_sent")) for d in done.values())
        / len(done),
        "agent_counters": {grid.members[i]: dict(d.get("counters", {}))
                           for i, d in sorted(done.items())},
    }  # fmt: skip

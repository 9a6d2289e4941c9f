"""Cut measured layers into S contiguous stages, balanced across the stages' boards.

Each stage runs on a board with a speed (GFLOPS) and a RAM budget. A stage's time
per training step is M micro-batches x its layers' measured seconds, scaled from
this host to its board; its memory is its parameters times the fp32 copies a
stage keeps (`PARAM_COPIES`) plus the activations of the micro-batches it holds
at once (all M under GPipe, S - s under 1F1B), each kept with its gradient.

`partition` picks the split that minimises the slowest stage's time among those
that fit every budget (dynamic programming over cut points, O(S n^2)); when none
fits, `NoFeasibleSplit` names the stage that ran out and the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fedring.firmware_profiles.schema import Profile
from fedring.pipeline.cost import LayerCost, StageSplitError
from fedring.pipeline.schedule import SCHEDULES, in_flight

MB = 1 << 20
# Weights, their gradient, the flat gradient handed to the reducer, the error-
# feedback residual and the optimizer's working copy.
PARAM_COPIES = 5


class NoFeasibleSplit(StageSplitError):
    """No split of the layers fits every stage's RAM budget."""


@dataclass(frozen=True)
class Board:
    """What a stage's board offers: speed and memory."""

    name: str
    gflops: float  # sustained fp64 HPL GFLOPS
    budget_mb: float  # RAM one job may take

    @classmethod
    def of(cls, profile: Profile) -> Board:
        return cls(profile.name, profile.gflops, profile.ram_budget_mb)


@dataclass(frozen=True)
class StageSpec:
    """One stage of the plan: its layers [start, end), board, and estimates."""

    index: int
    start: int
    end: int
    layers: tuple[str, ...]
    board: str
    params: int
    in_shape: tuple[int, ...]  # one sample's input to this stage
    memory_mb: float  # estimated peak, parameters and held activations
    budget_mb: float
    seconds: float  # estimated compute per training step on its board


@dataclass(frozen=True)
class StagePlan:
    """The split of a model into stages (printable; `to_dict` goes into summaries)."""

    stages: tuple[StageSpec, ...]
    micro_batches: int
    schedule: str
    host_gflops: float

    @property
    def bottleneck_s(self) -> float:
        return max(s.seconds for s in self.stages)

    def describe(self) -> str:
        lines = [f"pipeline: {len(self.stages)} stages, {self.micro_batches} micro-batches, "
                 f"{self.schedule}"]  # fmt: skip
        for s in self.stages:
            lines.append(
                f"  stage {s.index} on {s.board}: layers {s.start}..{s.end - 1} "
                f"({', '.join(s.layers)}), {s.params:,} params, ~{s.memory_mb:.2f} of "
                f"{s.budget_mb:.0f} MB, ~{s.seconds * 1e3:.2f} ms per step"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _memory_mb(costs: Sequence[LayerCost], i: int, j: int, input_bytes: int, held: int) -> float:
    params = sum(c.param_bytes for c in costs[i:j]) * PARAM_COPIES
    acts = (costs[i - 1].activation_bytes if i else input_bytes) + sum(
        c.activation_bytes for c in costs[i:j]
    )
    return (params + acts * 2 * held) / MB


def _seconds(
    costs: Sequence[LayerCost], i: int, j: int, board: Board, host: float, m: int
) -> float:
    return m * sum(c.seconds for c in costs[i:j]) * host / board.gflops


def _explain(costs: Sequence[LayerCost], boards: Sequence[Board], input_bytes: int,
             held: list[int]) -> NoFeasibleSplit:  # fmt: skip
    """Fill stages greedily from the left (optimal for feasibility): name where it fails."""
    i = 0
    for s, board in enumerate(boards):
        j = i
        while (
            j < len(costs) and _memory_mb(costs, i, j + 1, input_bytes, held[s]) <= board.budget_mb
        ):
            j += 1
        if j == i and i < len(costs):
            need = _memory_mb(costs, i, i + 1, input_bytes, held[s])
            return NoFeasibleSplit(
                f"stage {s} on {board.name}: layer {i} ({costs[i].name}) alone needs "
                f"~{need:.1f} MB, its budget is {board.budget_mb:.0f} MB"
            )
        i = j
    last = len(boards) - 1
    need = _memory_mb(costs, i, len(costs), input_bytes, held[last])
    return NoFeasibleSplit(
        f"stage {last} on {boards[last].name}: layers {i}..{len(costs) - 1} are left over "
        f"after every stage is full (~{need:.1f} MB more; budget {boards[last].budget_mb:.0f} "
        f"MB per board); add stages or bigger boards"
    )


def partition(
    costs: Sequence[LayerCost], boards: Sequence[Board], *, micro_batches: int, schedule: str,
    input_bytes: int, host_gflops: float,
) -> StagePlan:  # fmt: skip
    """The balanced split of `costs` over one stage per board (see the module docstring)."""
    n, stages = len(costs), len(boards)
    if schedule not in SCHEDULES:
        raise StageSplitError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if not 1 <= stages <= n:
        raise StageSplitError(f"{n} layers cannot be cut into {stages} non-empty stages")
    held = [in_flight(schedule, stages, micro_batches, s) for s in range(stages)]

    def fits(s: int, i: int, j: int) -> bool:
        return _memory_mb(costs, i, j, input_bytes, held[s]) <= boards[s].budget_mb

    # best[s][j]: the least bottleneck placing layers [0, j) on stages [0, s)
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == math.inf or not fits(s - 1, i, j):
                    continue
                t = max(
                    best[s - 1][i], _seconds(costs, i, j, boards[s - 1], host_gflops, micro_batches)
                )
                if t < best[s][j]:
                    best[s][j], cut[s][j] = t, i
    if best[stages][n] == math.inf:
        raise _explain(costs, boards, input_bytes, held)
    bounds, j = [], n
    for s in range(stages, 0, -1):
        bounds.append((cut[s][j], j))
        j = cut[s][j]
    return split_at(
        costs,
        boards,
        [i for i, _ in reversed(bounds)],
        micro_batches=micro_batches,
        schedule=schedule,
        input_bytes=input_bytes,
        host_gflops=host_gflops,
    )


def split_at(
    costs: Sequence[LayerCost], boards: Sequence[Board], starts: Sequence[int], *,
    micro_batches: int, schedule: str, input_bytes: int, host_gflops: float,
) -> StagePlan:  # fmt: skip
    """The plan whose stage s starts at layer ``starts[s]`` (``starts[0] == 0``): a
    task's own list of stage modules, one layer per stage, is ``range(len(stages))``.
    Budgets are checked as in `partition`."""
    n, count = len(costs), len(boards)
    ends = [*starts[1:], n]
    if (
        len(starts) != count
        or starts[0] != 0
        or any(a >= b for a, b in zip(starts, ends, strict=True))
    ):
        raise StageSplitError(f"stage starts {list(starts)} do not cut {n} layers into "
                              f"{count} non-empty stages")  # fmt: skip
    specs = []
    for s, (i, j) in enumerate(zip(starts, ends, strict=True)):
        held = in_flight(schedule, count, micro_batches, s)
        memory = _memory_mb(costs, i, j, input_bytes, held)
        if memory > boards[s].budget_mb:
            raise NoFeasibleSplit(
                f"stage {s} on {boards[s].name}: layers {i}..{j - 1} need "
                f"~{memory:.1f} MB, its budget is {boards[s].budget_mb:.0f} MB"
            )
        specs.append(StageSpec(
            s, i, j, tuple(c.name for c in costs[i:j]), boards[s].name,
            sum(c.params for c in costs[i:j]), costs[i - 1].out_shape if i else (),
            memory, boards[s].budget_mb,
            _seconds(costs, i, j, boards[s], host_gflops, micro_batches),
        ))  # fmt: skip
    return StagePlan(tuple(specs), micro_batches, schedule, host_gflops)

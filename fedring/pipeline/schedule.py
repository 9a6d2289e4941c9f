"""The order in which each stage runs the forward (F) and backward (B) of its micro-batches.

- ``gpipe`` (Huang et al. 2019): every stage runs all M forwards, then all M
  backwards; a stage holds the activations of all M micro-batches at once.
- ``1f1b`` (one forward, one backward; PipeDream-Flush, Narayanan et al. 2021):
  stage s runs S - s - 1 warm-up forwards, then alternates one forward and one
  backward, then drains; it holds at most S - s micro-batches at once.

Both flush at the end of the step, so both compute exactly the gradient of the
whole batch, and both leave the same bubble, (S - 1) / (M + S - 1) of the time
when stages are equally fast; 1F1B needs less memory. Backwards run in micro-
batch order 0..M-1 in both, so gradients accumulate in the order single-process
training on the same micro-batches accumulates them.

`timeline` replays the schedules with per-stage forward and backward seconds
and a per-hop transfer time: the step's makespan and its bubble fraction.

    >>> [str(op) for op in ops("1f1b", stages=2, micro_batches=3, stage=0)]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    >>> round(timeline("gpipe", [1.0, 1.0], [2.0, 2.0], micro_batches=4).bubble, 3)
    0.2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Op:
    kind: Literal["F", "B"]
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def ops(schedule: str, *, stages: int, micro_batches: int, stage: int) -> tuple[Op, ...]:
    """Stage `stage`'s operations for one training step, in order."""
    m = micro_batches
    if schedule == "gpipe":
        return tuple([Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)])
    if schedule != "1f1b":
        raise ValueError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    warm = min(stages - stage - 1, m)
    out = [Op("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [Op("F", warm + i), Op("B", i)]
    out += [Op("B", i) for i in range(m - warm, m)]
    return tuple(out)


def in_flight(schedule: str, stages: int, micro_batches: int, stage: int) -> int:
    """The most micro-batches whose activations `stage` holds at once."""
    held = peak = 0
    for op in ops(schedule, stages=stages, micro_batches=micro_batches, stage=stage):
        held += 1 if op.kind == "F" else -1
        peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class Timeline:
    makespan_s: float  # one step, first forward to last backward
    busy_s: float  # compute summed over the stages
    stages: int

    @property
    def bubble(self) -> float:
        """The fraction of stage-time spent idle (waiting for a neighbour)."""
        total = self.stages * self.makespan_s
        return 1.0 - self.busy_s / total if total > 0 else 0.0


def timeline(
    schedule: str, forward_s: Sequence[float], backward_s: Sequence[float], *,
    micro_batches: int, hop_s: float = 0.0,
) -> Timeline:  # fmt: skip
    """Replay one step: each stage runs its ops in order, each as soon as its input
    (the previous stage's forward, the next stage's backward, plus `hop_s`) is ready."""
    s_count = len(forward_s)
    queues = [list(ops(schedule, stages=s_count, micro_batches=micro_batches, stage=s))
              for s in range(s_count)]  # fmt: skip
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * s_count
    while any(queues):
        progressed = False
        for s, queue in enumerate(queues):
            while queue:
                op = queue[0]
                dep = (
                    ("F", s - 1, op.micro)
                    if op.kind == "F" and s > 0
                    else ("B", s + 1, op.micro)
                    if op.kind == "B" and s < s_count - 1
                    else None
                )
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + hop_s if dep is not None else 0.0
                cost = forward_s[s] if op.kind == "F" else backward_s[s]
                free[s] = max(free[s], ready) + cost
                done[(op.kind, s, op.micro)] = free[s]
                queue.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks: {queues}")
    busy = micro_batches * (sum(forward_s) + sum(backward_s))
    return Timeline(max(free), busy, s_count)

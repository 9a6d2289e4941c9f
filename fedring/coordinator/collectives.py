"""Which collective each epoch of a job runs, predicted beside measured.

Under ``collective = "auto"`` the coordinator plans every epoch (the first ring and
each re-formed one) from the members' probes (`Fleet.cost_probe`) with the cost
model (`collective.cost`, through `choose.choose_collective`); under a fixed
collective it still records the model's prediction for it. Each metrics row of the
epoch carries the collective and its predicted all-reduce seconds; the summary's
``collective`` list has, per epoch, every candidate's prediction, the predicted
round (the all-reduce, the slowest member's measured compute, and the head's wait
for its checkpoint: a round trip, the model up, the coordinator's save) and the
measured round (the median of the head's round-to-round wall time).
"""

from __future__ import annotations

import itertools
import logging
import statistics
from dataclasses import dataclass
from typing import Any

from fedring.choose import choose_collective
from fedring.collective.cost import Choice
from fedring.config import JobSpec
from fedring.coordinator.membership import Fleet

log = logging.getLogger(__name__)


@dataclass
class _Planned:
    epoch: int
    members: list[str]
    start_round: int
    choice: Choice
    numel: int


class CollectivePlans:
    def __init__(self) -> None:
        self.epochs: list[_Planned] = []
        self.saves: list[float] = []  # seconds each checkpoint took to write

    def plan(self, spec: JobSpec, epoch: int, members: list[str], fleet: Fleet, numel: int,
             start: int) -> str:  # fmt: skip
        """The collective of `members` from round `start` (logged and kept)."""
        probes = [fleet.cost_probe(a) for a in members]
        choice = choose_collective(spec.replace(agents=len(members)), numel, probes)
        self.epochs = [p for p in self.epochs if p.epoch != epoch]
        self.epochs.append(_Planned(epoch, list(members), start, choice, numel))
        predicted = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in choice.predicted_s.items())
        log.info("epoch %d: collective %s (%s; predicted all-reduce %s)", epoch,
                 choice.algorithm, spec.collective, predicted)  # fmt: skip
        return choice.algorithm

    def current(self, spec: JobSpec) -> str:
        return self.epochs[-1].choice.algorithm if self.epochs else spec.collective

    def tag(self, row: dict[str, Any]) -> dict[str, Any]:
        """`row` with the collective that ran it and that collective's prediction."""
        if not self.epochs:
            return row
        choice = self.epochs[-1].choice
        predicted = round(choice.predicted_s[choice.algorithm], 6)
        return {**row, "collective": choice.algorithm, "collective_predicted_s": predicted}

    def summary(
        self, spec: JobSpec, rows: dict[int, dict[str, Any]], fleet: Fleet
    ) -> list[dict[str, Any]]:
        """Per epoch: the choice, every prediction, predicted and measured round."""
        out = []
        ends = [p.start_round for p in self.epochs[1:]] + [max(rows, default=0) + 1]
        for planned, end in zip(self.epochs, ends, strict=True):
            walls = [float(rows[r]["wall_s"]) for r in sorted(rows)
                     if planned.start_round <= r < end and "wall_s" in rows[r]]  # fmt: skip
            gaps = [b - a for a, b in itertools.pairwise(walls)]
            steps = spec.local_steps if spec.sync != "sync" else 1
            compute = max((fleet.step_s.get(a, 0.0) for a in planned.members), default=0.0)
            chosen = planned.choice.predicted_s[planned.choice.algorithm]
            # the head waits for its checkpoint's ack: up to the broker, saved, acked
            head, save = fleet.cost_probe(planned.members[0]), self._save_s()
            gate = (head.rtt_s + head.up(4 * planned.numel) + save) / spec.checkpoint_every
            out.append({
                "epoch": planned.epoch, "members": len(planned.members),
                "from_round": planned.start_round, **planned.choice.to_dict(),
                "predicted_round_s": round(chosen + steps * compute + gate, 6),
                "measured_round_s": round(statistics.median(gaps), 6) if gaps else None,
            })  # fmt: skip
        return out

    def _save_s(self) -> float:
        return statistics.median(self.saves) if self.saves else 0.0

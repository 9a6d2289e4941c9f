"""Which collective each epoch of a job runs, predicted beside measured.

Under ``collective = "auto"`` the coordinator plans every epoch (the first ring and
each re-formed one) from the members' probes (`Fleet.cost_probe`) with the cost
model (`collective.cost`, through `choose.choose_plan`); under a fixed
collective it still records the model's prediction for it. Each metrics row of the
epoch carries the collective and its predicted all-reduce seconds; the summary's
``collective`` list has, per epoch, every candidate's prediction, the predicted
round (the all-reduce, the slowest member's measured compute, and the head's wait
for its checkpoint: a round trip, the members' slices up, the coordinator's save) and the
measured round (the median of the head's round-to-round wall time, past the density
warm-up when the epoch runs past it: the model predicts the target density's payload).

In the density warm-up each stage has a plan of its own (`choose.warmup_stage`): its
payloads are 25, 6.25 and 1.56x the target's, so the ring that is fastest for the
first can be slower than fan-out for the rest. The plan is chosen for the stage's
payloads and rounds factor and chosen again where the stage ends: the same plan goes
on with the next stage's predictions, another re-forms the ring (a re-plan like the
ones below; the summary's epoch says its ``stage_density``, and each first plan's
seconds on its best path through the warm-up, ``path_s``). Past the warm-up a plan
holds until that check; where a job ends in a warm-up stage, the plan is chosen by
each candidate's mean all-reduce over the rounds left (`choose.horizon_seconds`).
Until the job has measured its own, each frame a member takes in costs `HOP_PRIOR_S`
beyond the probes, times the cores it shares (`collective.cost`).

The model is a prediction; ``auto`` checks it against the job. After
`CALIBRATION_ROUNDS` of the head's rows past the warm-up it takes the median measured
all-reduce (the rows' ``comm_s``) and learns, once a job, the per-frame cost the probes
missed (``hop_s``: the excess over the prediction spread over the frames on the plan's
critical path, `hop_units`; frames checked and handed between threads). The model errs the
other way too (a token-bucket link lets a small message through at line rate, where
the model charges it the average rate), so it does not stop at re-predicting: every
candidate not yet run on these members whose prediction, with that per-frame cost, is
within reach of the measured all-reduce is tried for as long, the fastest first, and
then the job settles on the fastest measured. The reach is how far the model missed the
plan it ran (measured over predicted, or the inverse), between `TRY_FLOOR` and
`TRY_WITHIN` (`reach`): where the job measured its plan as predicted, a runner-up
predicted 15 to 25% slower is not worth a trial (the grid's N = 8 CNN at 10 Mbit/s: the
hub measured 13.1 ms against 12.5 predicted, fan-out tried at 16.0 predicted measured
21.5), and where the model missed by more, so may its other predictions have. Each try
and the settling are a re-plan: logged, counted (``collective_replanned``), an event in
the summary, not a break of the ring (`Degrade`); the members go on from the round they halted at
(`coordinator.epoch.held_round`), so a re-plan costs a halt and a manifest, tens of ms. Each
candidate runs at most once on the same members before they settle, so re-plans end.
A trial runs `TRIAL_ROUNDS` before it is measured, so one the job would likely end
during is not started (`rounds_left`: its last round, or the head's accuracy's trend
to the target): the plan is kept, and the summary's epoch says what was ``not_tried``.

Under ``compression = "auto"`` the candidates are plans, a codec with a collective
(`choose.plans`): a dense plan is tried like a collective, and judged against
group-top-k also without the learned per-frame cost (`_again`), so a group-top-k
slowed by its own CPU still meets the dense ring. Plans of different codecs are
compared by their time to the target (`choose.to_target`: group-top-k needs more
rounds than dense, so its round must be that much shorter), with the round's compute
the members measured: their acks' step of the job's model when the epoch is planned,
the head's rows (``compute_s``) when it is checked. The epoch's codec goes into its
manifests (`codec`) and each row (``codec``).

Each step waits at most the job's ``timeout_s``. Where an epoch's plan has a step
predicted within `DEADLINE_MARGIN` of it (`choose.longest_wait`: the epoch's first
payloads over the members' measured links), the epoch's manifests carry a longer
deadline (``timeout_s``, `step_timeout_s`), and the coordinator's stall limit grows too.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from fedring.aggregation.rules import Aggregation
from fedring.build import needs_centre
from fedring.choose import (
    choose_plan,
    choosing,
    codec_choosable,
    longest_wait,
    to_target,
    warmup_stage,
)
from fedring.collective.cost import Choice, Probe, codec_of, hop_units
from fedring.compression.schedule import DensitySchedule
from fedring.config import MAX_TIMEOUT_S, JobSpec
from fedring.coordinator.membership import Fleet

log = logging.getLogger(__name__)

CALIBRATION_ROUNDS = 20  # the head's rows an ``auto`` epoch measures before it checks
# the rounds a tried plan runs before it is measured: the re-formed ring's first two,
# then `CALIBRATION_ROUNDS` of the head's rows, and the halt
TRIAL_ROUNDS = CALIBRATION_ROUNDS + 3
TREND_EVALS = 5  # the head's newest evaluations whose trend says when the target is near
TRY_WITHIN = 1.25  # try a collective predicted within this factor of the measured one
TRY_FLOOR = 1.1  # ... at least, where the model predicted the plan that ran closer (`reach`)
# Each frame's cost the probes miss (`collective.cost.hop_units`), until the job has
# measured its own (`replan`): about the least the edge lab's grid measured, 0.38 ms a
# frame where each of four members on two cores took one (the CNN's ring at 1 Mbit/s,
# 0.76 ms a step); 0.7 ms where eight on two took seven each (the digits MLP's fan-out at
# 50 Mbit/s; `docs/lab.md`, "Shared cores"). Zero made the first plan of a short job
# count the ring's six steps as free beside fan-out's one.
HOP_PRIOR_S = 4e-4
DEADLINE_MARGIN = 1.5  # a late plan's step deadline over its predicted longest step
# A re-formation's cost where a warm-up stage's plan changes: a halt and a manifest, about
# four broker round trips and the members' restart (74 ms with one round measured over
# a loopback broker, `docs/lab.md`)
REFORM_S = 0.05
REFORM_TRIPS = 4


def rounds_to_check(spec: JobSpec, start: int) -> int:
    """The rounds a plan chosen at round `start` runs before its first check: to the
    end of the warm-up (or the new ring's first two), then `CALIBRATION_ROUNDS` of the
    head's rows."""
    return max(warmup_rounds(spec), start + 2) + CALIBRATION_ROUNDS + 1 - start


def reach(measured: float, predicted: float) -> float:
    """How much slower than the measured all-reduce a plan may be predicted and still be
    tried: by as much as the model missed the plan that ran, from `TRY_FLOOR` to
    `TRY_WITHIN` (the widest where either figure is unknown)."""
    if measured <= 0 or predicted <= 0:
        return TRY_WITHIN
    missed = max(measured / predicted, predicted / measured)
    return min(TRY_WITHIN, max(TRY_FLOOR, missed))


def reform_seconds(probes: list[Probe]) -> float:
    """What re-forming the ring costs these members (`REFORM_S`, `REFORM_TRIPS`)."""
    return REFORM_S + REFORM_TRIPS * max((p.rtt_s for p in probes), default=0.0)


@dataclass
class _Planned:
    epoch: int
    members: list[str]
    start_round: int
    choice: Choice
    numel: int
    probes: list[Probe]
    hop_s: float  # the per-frame cost the prediction included
    comm: list[float] = field(default_factory=list)  # measured all-reduce seconds
    compute: list[float] = field(default_factory=list)  # measured compute seconds a round
    compute_s: float = 0.0  # the round's compute the plan assumed (0: unknown)
    checked: bool = False
    step_timeout_s: float = 0.0  # its steps' deadline where the job's was too short
    until: int = 0  # the round its warm-up stage ends, where the plan is chosen again; 0: none
    density: float = 0.0  # the warm-up stage's density its choice was made for; 0: the job's
    # each first plan's seconds on its best path through the warm-up left (`_choose`)
    path_s: dict[str, float] = field(default_factory=dict)
    not_tried: dict[str, Any] = field(default_factory=dict)  # a trial the job's end forbade


@dataclass(frozen=True)
class _Pick:
    """What `CollectivePlans._choose` decided (the fields of `_Planned` of those names)."""

    choice: Choice
    until: int = 0
    density: float = 0.0
    path_s: dict[str, float] = field(default_factory=dict)


def _round_compute(spec: JobSpec, fleet: Fleet, members: list[str]) -> float:
    """A round's compute on the slowest of `members`: its measured step of the job's
    model (from its manifest ack; 0 where none has come) x the steps a round runs."""
    step = max((fleet.step_s.get(a, 0.0) for a in members), default=0.0)
    return step * (spec.local_steps if spec.sync != "sync" else 1)


def warmup_rounds(spec: JobSpec) -> int:
    """Rounds of the density warm-up (denser payloads than the model predicts for)."""
    if spec.compression != "group-topk":
        return 0
    return DensitySchedule(float(spec.density), steps_per_stage=spec.density_warmup).warmup_steps


def rounds_left(spec: JobSpec, now: int, evals: list[tuple[int, float]]) -> float:
    """The rounds the job likely runs after round `now`: to ``spec.rounds``, or fewer
    where it stops at its target accuracy and nears it. The least-squares line through
    the head's newest `TREND_EVALS` evaluations (round, accuracy) at or before `now`,
    taken from where it stands at `now` to the target. The job's rounds left where that
    says nothing: no target, a rule that does not stop at it (hybrid), fewer than three
    evaluations, or accuracy not rising."""
    left = float(max(spec.rounds - now, 0))
    recent = [(r, a) for r, a in evals if r <= now][-TREND_EVALS:]
    stops = Aggregation.parse(spec.aggregation).kind != "hybrid"  # `build.loop_settings`
    if not spec.target_accuracy or not stops or len(recent) < 3:
        return left
    slope, intercept = statistics.linear_regression(*zip(*recent, strict=True))
    if slope <= 0:
        return left
    at_now = intercept + slope * now
    return min(left, max(spec.target_accuracy - at_now, 0.0) / slope)


class CollectivePlans:
    def __init__(self, hop_prior_s: float = HOP_PRIOR_S) -> None:
        self.epochs: list[_Planned] = []
        self.saves: list[float] = []  # seconds each checkpoint took to write
        # each step's unseen cost: the prior, then learned from the first measured
        # epoch of an ``auto`` job
        self.hop_s = hop_prior_s
        self.learned = False
        # median measured all-reduce of each collective that ran, per member list
        self.measured: dict[tuple[str, ...], dict[str, float]] = {}
        self.settled: set[tuple[str, ...]] = set()  # members whose candidates were tried
        self.pending = ""  # the collective a re-plan asked for
        self.codecs = False  # compression "auto": the plans choose the codec too
        self.late_plans: set[str] = set()  # plans whose steps outlast the job's deadline
        self.step_timeout_s = 0.0  # the current epoch's step deadline; 0: the job's
        self.head_round = 0  # the head's newest row: the rounds the job has run
        self.evals: list[tuple[int, float]] = []  # the head's evaluations: round, accuracy

    def plan(self, spec: JobSpec, epoch: int, members: list[str], fleet: Fleet, numel: int,
             start: int) -> str:  # fmt: skip
        """The collective of `members` from round `start` (logged and kept)."""
        probes = [replace(p, hop_s=self.hop_s) for p in fleet.cost_probes(members)]
        compute = _round_compute(spec, fleet, members)
        spec = spec.replace(agents=len(members))  # the rounds factor grows with the ring
        pick = self._choose(spec, members, probes, numel, compute, start)
        choice, until = pick.choice, pick.until
        same = bool(self.epochs) and self.epochs[-1].members == members
        if self.pending in choice.predicted_s and same:
            choice = replace(choice, algorithm=self.pending)  # a re-plan's: trial, stage or best
        self.codecs = codec_choosable(spec)
        self.pending = ""
        self.head_round = start  # a ring re-formed from a checkpoint goes back to its round
        self.epochs = [p for p in self.epochs if p.epoch != epoch]
        self.epochs.append(_Planned(epoch, list(members), start, choice, numel, probes,
                                    self.hop_s, compute_s=compute, until=until,
                                    density=pick.density, path_s=pick.path_s))  # fmt: skip
        predicted = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in choice.predicted_s.items())
        log.info("epoch %d: collective %s (%s; predicted all-reduce %s%s)", epoch,
                 choice.algorithm, spec.collective, predicted,
                 f"; the warm-up stage to round {until}" if until else "")  # fmt: skip
        self.step_timeout_s = self._deadline(spec, epoch, choice.algorithm, probes, numel, start)
        self.epochs[-1].step_timeout_s = self.step_timeout_s
        return choice.collective

    def _choose(self, spec: JobSpec, members: list[str], probes: list[Probe], numel: int,
                compute: float, start: int, keep: str = "",
                ) -> _Pick:  # fmt: skip
        """The plan of `members` from round `start`, the round it is chosen again (0:
        none) and the warm-up stage's density it was chosen for (0: the job's).

        In the density warm-up (`choose.warmup_stage`) each stage left and then the
        target's rounds to the first check are phases: each plan's seconds in a phase are
        its rounds there x its time a round (`choose.to_target`, at the phase's density),
        and a change of plan between phases costs a re-formation (`reform_seconds`; from
        `keep`, the plan running now, too). The plan of the first phase on the path of
        fewest seconds is chosen, and chosen again where its stage ends (`replan`).
        Past the warm-up the plan holds until `replan` first checks it (`observe`),
        chosen by its mean over those rounds where a job ends in a warm-up stage."""
        if not choosing(spec) or warmup_stage(spec, start) is None:
            choice, times = self._held(spec, members, probes, numel, compute, start)
            if choosing(spec):  # over the rounds to the first check; leaving `keep` re-forms
                held = rounds_to_check(spec, start)
                reform = reform_seconds(probes)
                total = {a: held * t + (reform if keep and a != keep else 0.0)
                         for a, t in times.items()}  # fmt: skip
                choice = replace(choice, algorithm=min(total, key=total.__getitem__))  # tie: first
            return _Pick(choice)
        phases, at = [], start
        while (stage := warmup_stage(spec, at)) is not None:
            basis, end = stage
            choice = choose_plan(basis, numel, probes, compute)
            seconds = {a: (end - at) * to_target(basis, a, v, compute)
                       for a, v in choice.predicted_s.items()}  # fmt: skip
            phases.append((choice, seconds, end, float(basis.density)))
            at = end
        _, times = self._held(spec, members, probes, numel, compute, at)
        held = rounds_to_check(spec, at)
        reform = reform_seconds(probes)
        ahead = {a: held * t for a, t in times.items()}  # the path's seconds from a phase on
        for _, seconds, _, _ in reversed(phases):
            ahead = {a: seconds[a] + min(ahead[b] + (0.0 if b == a else reform) for b in ahead)
                     for a in seconds}  # fmt: skip
        choice, _, until, density = phases[0]
        order = list(choice.predicted_s)
        total = {a: ahead[a] + (reform if keep and a != keep else 0.0) for a in order}
        best = min(order, key=lambda a: (total[a], order.index(a)))
        return _Pick(replace(choice, algorithm=best), until, density, total)

    def _held(self, spec: JobSpec, members: list[str], probes: list[Probe], numel: int,
              compute: float, start: int) -> tuple[Choice, dict[str, float]]:  # fmt: skip
        """The plans from round `start` past the warm-up, and each one's time a round to
        the target over the rounds it holds before its first check (measured on these
        members where it ran, else predicted: over the horizon where it holds a stage)."""
        horizon = rounds_to_check(spec, start)
        choice = choose_plan(spec, numel, probes, compute, start, horizon)
        expected = self._expected(members, choice)
        return choice, {a: to_target(spec, a, v, compute) for a, v in expected.items()}

    def _deadline(self, spec: JobSpec, epoch: int, plan: str, probes: list[Probe],
                  numel: int, start: int) -> float:  # fmt: skip
        """The epoch's step deadline where the job's ``timeout_s`` is too short for its
        plan, else 0 (the job's own): `DEADLINE_MARGIN` x the plan's longest step
        (`choose.longest_wait`), at most `MAX_TIMEOUT_S`, where that is longer than
        the job's. With the job's deadline its members would time out and the ring
        re-form for ever (8 members of a hub at 1 Mbit/s with the 1 M-parameter MLP: the
        warm-up's payloads take two minutes at the hub, `docs/lab.md`), or run with no
        margin (the same fan-out: rounds of 58 s measured)."""
        wait = longest_wait(spec, numel, probes, plan, start)
        longer = min(float(math.ceil(DEADLINE_MARGIN * wait)), MAX_TIMEOUT_S)
        if longer <= spec.timeout_s:
            return 0.0
        if plan not in self.late_plans:  # once a plan: every re-formed ring would say it again
            self.late_plans.add(plan)
            log.warning("epoch %d: %s's longest step from round %d is predicted at %.0f s "
                        "over the members' measured links, too close to timeout_s = %g s: "
                        "its steps wait up to %g s", epoch, plan, start, wait, spec.timeout_s,
                        longer)  # fmt: skip
        return longer

    def _expected(self, members: list[str], choice: Choice) -> dict[str, float]:
        """Each candidate's all-reduce: measured on these members, else predicted (over
        the plan's horizon where the warm-up falls in it)."""
        seen = self.measured.get(tuple(members), {})
        return {a: seen.get(a, choice.expected(a)) for a in choice.predicted_s}

    def observe(self, spec: JobSpec, rnd: int, row: dict[str, Any]) -> None:
        """Keep the head's measured all-reduce of round `rnd` (past the warm-up)."""
        if not self.epochs or not choosing(spec):
            return
        self.head_round = max(self.head_round, rnd)
        accuracy = row.get("accuracy")
        if isinstance(accuracy, int | float) and math.isfinite(accuracy):
            # the newest few only (`rounds_left`); a ring re-formed from an earlier
            # round drops those past it as its own evaluations come
            newer = [e for e in self.evals[-TREND_EVALS:] if e[0] < rnd]
            self.evals = [*newer, (rnd, float(accuracy))]
        planned, comm = self.epochs[-1], row.get("comm_s")
        # past a new ring's start, and past the density warm-up unless the plan sends dense
        warm = 0 if codec_of(planned.choice.algorithm) == "dense" else warmup_rounds(spec)
        first = max(warm, planned.start_round + 2)
        if planned.checked or rnd <= first or not isinstance(comm, int | float) or comm <= 0:
            return
        planned.comm.append(float(comm))
        compute = row.get("compute_s")
        if isinstance(compute, int | float) and compute >= 0:
            planned.compute.append(float(compute))

    def replan(self, spec: JobSpec) -> str:
        """Why the job should re-form with another collective now, or "" (`observe`)."""
        if self.epochs and self.epochs[-1].until and self.head_round >= self.epochs[-1].until:
            return self._next_stage(spec, self.epochs[-1])
        if not self.epochs or len(self.epochs[-1].comm) < CALIBRATION_ROUNDS:
            return ""
        planned = self.epochs[-1]
        if planned.checked:
            return ""
        planned.checked = True
        key, chosen, world = tuple(planned.members), planned.choice.algorithm, len(planned.members)
        measured = statistics.median(planned.comm)
        seen = self.measured.setdefault(key, {})
        seen[chosen] = measured
        predicted = planned.choice.predicted_s[chosen]
        if not self.learned:
            n = hop_units(chosen, planned.probes, spec.topology)
            # the prediction held the plan's frames' cost already: the excess is beyond it
            excess = (measured - predicted) / n if n else 0.0
            self.hop_s = max(0.0, planned.hop_s + excess) if n else 0.0
            self.learned = True
        if key in self.settled:
            return ""
        spec = spec.replace(agents=world)
        again = self._again(spec, planned, chosen)
        compute = statistics.median(planned.compute) if planned.compute else planned.compute_s
        time = {a: to_target(spec, a, v, compute) for a, v in again.items()}
        now = to_target(spec, chosen, measured, compute)
        # within reach of the measured all-reduce (`reach`), the tolerance on the
        # all-reduce alone (not on the compute every plan pays)
        within = reach(measured, predicted)
        reach_s = {a: to_target(spec, a, v / within, compute) for a, v in again.items()}
        untried = [a for a in again if a not in seen and reach_s[a] <= now]
        left = rounds_left(spec, self.head_round, self.evals) if untried else math.inf
        if left < TRIAL_ROUNDS:  # it would end during the trial: no gain
            trial = min(untried, key=time.__getitem__)
            planned.not_tried = {"plan": trial, "rounds_left": round(left, 1)}
            log.info("not trying %s: the job likely ends in %.0f rounds (its last round, or "
                     "its accuracy's trend to the target), a trial runs %d", trial, left,
                     TRIAL_ROUNDS)  # fmt: skip
            untried = []
        if untried:
            self.pending = min(untried, key=time.__getitem__)  # a tie: the first listed
            return (f"trying {self.pending}: predicted {again[self.pending] * 1e3:.1f} ms an "
                    f"all-reduce, {chosen} measured {measured * 1e3:.1f} (predicted "
                    f"{predicted * 1e3:.1f}; {self.hop_s * 1e3:.2f} ms a frame the probes "
                    "missed)")  # fmt: skip
        self.settled.add(key)
        best = min(seen, key=lambda a: to_target(spec, a, seen[a], compute))
        if best == chosen:
            return ""
        self.pending = best
        return (f"back to {best}: {seen[best] * 1e3:.1f} ms an all-reduce measured, "
                f"{chosen} {measured * 1e3:.1f}")  # fmt: skip

    def _next_stage(self, spec: JobSpec, planned: _Planned) -> str:
        """The plan for the round the job has reached, its warm-up stage over (`_choose`):
        the same plan goes on with that stage's predictions (the next check compares
        them with the measured all-reduce); another re-forms the ring."""
        start, chosen = self.head_round, planned.choice.algorithm
        probes = [replace(p, hop_s=self.hop_s) for p in planned.probes]
        spec = spec.replace(agents=len(planned.members))
        pick = self._choose(spec, planned.members, probes, planned.numel, planned.compute_s,
                            start, keep=chosen)  # fmt: skip
        choice, density = pick.choice, pick.density
        if choice.algorithm == chosen:
            planned.choice, planned.until, planned.density = choice, pick.until, density
            planned.probes, planned.hop_s, planned.path_s = probes, self.hop_s, pick.path_s
            return ""
        planned.until = 0  # asked once; the re-formed epoch plans its own stage
        self.pending = choice.algorithm
        at = f"density {density:g}" if density else "the target density"
        return (f"the warm-up stage ended at round {start}: at {at} {self.pending} is "
                f"predicted at {choice.expected(self.pending) * 1e3:.1f} ms an all-reduce, "
                f"{chosen} at {choice.expected(chosen) * 1e3:.1f}")  # fmt: skip

    def _again(self, spec: JobSpec, planned: _Planned, chosen: str) -> dict[str, float]:
        """Each plan re-predicted with the learned per-frame cost. A dense plan measured
        against group-top-k also without it: the excess group-top-k measured may be
        its own codec CPU (under load the model was 3 to 4x low), which dense does not
        pay; the cheaper reading decides whether dense is tried."""
        hopped = [replace(p, hop_s=self.hop_s) for p in planned.probes]
        again = dict(choose_plan(spec, planned.numel, hopped).predicted_s)
        if self.codecs and codec_of(chosen) != "dense":
            plain = [replace(p, hop_s=0.0) for p in planned.probes]
            for plan, seconds in choose_plan(spec, planned.numel, plain).predicted_s.items():
                if codec_of(plan) == "dense":
                    again[plan] = min(again[plan], seconds)
        return again

    def current(self, spec: JobSpec) -> str:
        return self.epochs[-1].choice.collective if self.epochs else spec.collective

    def codec(self) -> str:
        """The current epoch's codec for its manifests: "dense" where ``compression =
        "auto"`` chose the dense fp32 plan, else "" (the job's group-top-k)."""
        chosen = self.epochs[-1].choice.algorithm if self.epochs and self.codecs else ""
        return "dense" if codec_of(chosen) == "dense" else ""

    def tag(self, row: dict[str, Any]) -> dict[str, Any]:
        """`row` with the collective that ran it and that collective's prediction."""
        if not self.epochs:
            return row
        choice = self.epochs[-1].choice
        predicted = round(choice.predicted_s[choice.algorithm], 6)
        codec = {"codec": codec_of(choice.algorithm)} if self.codecs else {}
        return {**row, "collective": choice.collective, **codec,
                "collective_predicted_s": predicted}  # fmt: skip

    def summary(
        self, spec: JobSpec, rows: dict[int, dict[str, Any]], fleet: Fleet
    ) -> list[dict[str, Any]]:
        """Per epoch: the choice, every prediction, predicted and measured round. A job
        whose updates go through the coordinator (star, a robust rule, async) runs no
        collective: its entries say which centre it is, not the ring it never ran."""
        out = []
        centre = "async" if spec.sync == "async" else "star" if needs_centre(spec) else ""
        ends = [p.start_round for p in self.epochs[1:]] + [max(rows, default=0) + 1]
        for planned, end in zip(self.epochs, ends, strict=True):
            dense = codec_of(planned.choice.algorithm) == "dense"
            warm = 0 if dense else warmup_rounds(spec)
            first = max(planned.start_round, warm) if warm < end - 2 else planned.start_round
            walls = [float(rows[r]["wall_s"]) for r in sorted(rows)
                     if first <= r < end and "wall_s" in rows[r]]  # fmt: skip
            gaps = [b - a for a, b in itertools.pairwise(walls)]
            steps = spec.local_steps if spec.sync != "sync" else 1
            compute = max((fleet.step_s.get(a, 0.0) for a in planned.members), default=0.0)
            chosen = planned.choice.predicted_s[planned.choice.algorithm]
            # the head waits for the checkpoint before the last: the newest one's wait
            # overlaps the `checkpoint_every` rounds after it (`running.Running.gate`)
            every, rnd = spec.checkpoint_every, chosen + steps * compute
            gate = max(0.0, self._checkpoint_wait(spec, planned, fleet) - every * rnd) / every
            choice: dict[str, Any] = planned.choice.to_dict()
            if self.codecs:
                choice["codec"] = codec_of(planned.choice.algorithm, spec.compression)
                # what the plan compared: each plan's round, weighed by its extra rounds
                choice["compute_s"] = round(planned.compute_s, 6)
                members = spec.replace(agents=len(planned.members),
                                       density=planned.density or spec.density)  # fmt: skip
                choice["to_target_s"] = {
                    a: round(to_target(members, a, v, planned.compute_s), 6)
                    for a, v in planned.choice.predicted_s.items()
                }
            predicted: float | None = round(chosen + steps * compute + gate, 6)
            if centre:
                predicted = None
                choice = {"chosen": centre, "predicted_s": {},
                          "why": f"a {centre} job: every update goes through the coordinator's "
                                 "centre; no collective runs between the agents"}  # fmt: skip
            stage = ({"stage_density": planned.density,
                      "path_s": {k: round(v, 6) for k, v in planned.path_s.items()}}
                     if planned.density else {})  # fmt: skip
            out.append({
                "epoch": planned.epoch, "members": len(planned.members),
                "from_round": planned.start_round, **choice, **stage,
                "predicted_round_s": predicted,
                "measured_round_s": round(statistics.median(gaps), 6) if gaps else None,
                "measured_from_round": first,
                "measured_allreduce_s": (round(statistics.median(planned.comm), 6)
                                         if planned.comm else None),
                "hop_s": round(planned.hop_s, 6),
                "shared_cores": round(max((p.load for p in planned.probes), default=1.0), 3),
                **({"step_timeout_s": planned.step_timeout_s} if planned.step_timeout_s else {}),
                **({"not_tried": planned.not_tried} if planned.not_tried else {}),
            })  # fmt: skip
        return out

    def _checkpoint_wait(self, spec: JobSpec, planned: _Planned, fleet: Fleet) -> float:
        """The head's wait for a checkpoint's ack: the slowest sender's round trip and
        upload, and the coordinator's save. Past a segment's first checkpoint the members
        other than the head each send a patch of their slice (`edge_agent.checkpoint_stream`),
        at most the slice's dense fp32 (`wire.patch`); the ``hybrid`` rule keeps the
        head's whole upload (so does a ring of mixed architectures, not told apart here)."""
        members = planned.members
        if len(members) > 1 and Aggregation.parse(spec.aggregation).kind != "hybrid":
            share = 4 * planned.numel / (len(members) - 1)
            senders = [fleet.cost_probe(a) for a in members[1:]]
            wait = max(p.rtt_s + p.up(share) for p in senders)
        else:
            head = fleet.cost_probe(members[0])
            wait = head.rtt_s + head.up(4 * planned.numel)
        return wait + self._save_s()

    def _save_s(self) -> float:
        return statistics.median(self.saves) if self.saves else 0.0

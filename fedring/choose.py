"""`collective = "auto"` and `compression = "auto"`: the job's plan for these members.

The coordinator calls `choose_plan` when a ring forms and again each time it
re-forms (`fedring simulate` calls `choose_collective`, the collective alone): it
states the job's round as a `collective.cost.Workload` (entries, one member's
payload on the wire, the dense vector) and lets the cost model pick among the plans
the job may use (`plans`). A job that may only use the ring (a torus topology, a
star, asynchronous rounds, a sign vote, a pipeline) gets the ring without a
prediction of the others.

Under ``compression = "auto"`` the codec is part of the plan: beside group-top-k at
the job's density (the accuracy policy's, `compression.policy`: the codec choice
trades time, never accuracy, so it never goes sparser) the candidates hold the dense
one of each collective the job may use ("dense ring", "dense fanout", "dense hub"):
fp32 on the ring, and on the one-step collectives every entry at the job's value dtype
(fp16 by default, as group-top-k sends its values; summed in fp32 in rank order by every
member, so the members stay identical): half the bytes.
Each is predicted as the alpha-beta communication plus the members' codec CPU from
their hellos (gamma: group-top-k's measured encode and decode, a dense entry's copy
and add); the compute is the same for every plan, so it does not move the choice.
The dense plans are listed first, so a tie goes to dense: `auto` is never predicted
slower than the dense ring (or the job's collective, dense) on the same link.

A user waits for the target, not for a round. Group-top-k with error feedback needs
more rounds to reach it than dense (a left-out coordinate waits about ``1 / density``
rounds for its turn), so a plan is judged by its time to target: `rounds_factor`
(dense 1) x (the round's compute + the plan's all-reduce), with the compute the
members measured (`to_target`). The factor is a prior, measured in the edge lab's
grid and in process (`docs/lab.md`, "Rounds to target, by collective"):
- fan-out and the hub sum the members' exact payloads: `ROUNDS_AT_FLOOR`, 1.91 at the
  policy's floor density (the MNIST-1D CNN at N = 4; 0.8 to 2.2 measured over four models
  from N = 2 to 16), shrinking as ``FLOOR / density`` above it;
- the ``bounded`` ring re-selects the top k of each partial sum at every one of its
  reduce-scatter steps and holds the rest back in error feedback, so past N = 4 it needs
  more rounds the more steps it takes: the one-step factor x ``1 + RING_STEP x (steps -
  RING_FREE_STEPS)`` (in process, the CNN's ring needed 1.0, 1.1, 1.7 and 2.9x fan-out's
  rounds at N = 2, 4, 8 and 16; the digits MLP's 1.0, 1.4, 1.5 and 2.4x). The ``exact``
  ring sums exactly: none.
The factor counts whenever plans with different factors are compared: dense against
group-top-k, and the ring against the one-step collectives under ``collective = "auto"``
alone. Erring towards dense costs little where the link is the bottleneck (group-top-k's
round is then 10 to 20x shorter) and keeps `auto` from losing to the dense ring where the
CPU is.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from fedring.aggregation.rules import Aggregation
from fedring.collective.cost import (
    ALGORITHMS,
    DENSE,
    Choice,
    Probe,
    Workload,
    choose,
    codec_of,
    collective_of,
    predict,
    steps,
)
from fedring.compression.group_topk import GroupTopK
from fedring.compression.policy import FLOOR
from fedring.compression.schedule import DensitySchedule
from fedring.compression.values import BYTES_PER_VALUE, float_wire
from fedring.config import JobSpec

HEADER_BYTES = 64  # a compact frame's header is at most this (`wire.compact`)
# payload size measured on at most this many entries, then scaled: a group's bytes do
# not depend on its values (k of G kept), so 64 Ki entries give the 1 Mi sample's figure
# to the byte for every grid model and density, in 0.3 ms instead of 50 to 100 (the
# first plan measures one payload per warm-up density)
_MAX_SAMPLE = 1 << 16
# rounds to the target of group-top-k at the policy's floor (1%) over dense's on a
# one-step collective (fan-out, the hub): the MNIST-1D CNN's at N = 4 (the docstring)
ROUNDS_AT_FLOOR = 1.91
# the bounded ring's extra rounds over a one-step collective's: none for its first
# `RING_FREE_STEPS` reduce-scatter re-selections (N = 4 and less: 1.0 to 1.4x measured,
# where the ring often wins on time: counting them lost two of three lab cells checked),
# then `RING_STEP` for each one more: the least-squares slope (0.127) of (ring's rounds /
# one-step's - 1) over eight measurements at N = 8 and 16 (`docs/lab.md`, "Rounds to
# target, by collective"; `bench/rounds_by_collective.py`)
RING_FREE_STEPS = 3
RING_STEP = 0.13


def candidates(spec: JobSpec) -> tuple[str, ...]:
    """The collectives this job may use (`config._check_collective`'s rule)."""
    one_step = (spec.topology in ("auto", "ring") and spec.sync != "async"
                and Aggregation.parse(spec.aggregation).kind in ("mean", "weighted")
                and spec.pipeline_stages == 1)  # fmt: skip
    return ALGORITHMS if one_step else ("ring",)


def codec_choosable(spec: JobSpec) -> bool:
    """Whether the coordinator may plan this job's codec: ``compression = "auto"`` in a
    job whose all-reduce runs between the agents (sync or local rounds of a mean, not
    a star (client sampling is one), an asynchronous job, a sign vote or a pipeline): there the
    reducer can send dense fp32 for a segment (`engine.reducer.Reducer.dense`)."""
    return (spec.compression_auto and spec.topology != "star" and spec.sync != "async"
            and Aggregation.parse(spec.aggregation).kind in ("mean", "weighted")
            and spec.pipeline_stages == 1)  # fmt: skip


def plans(spec: JobSpec) -> tuple[str, ...]:
    """What the coordinator may choose among, in tie order: the collectives (all of them
    under ``collective = "auto"``, else the job's), and where the codec is chosen too
    each of them with dense fp32 first."""
    collectives = candidates(spec) if spec.collective == "auto" else (spec.collective,)
    if not codec_choosable(spec):
        return collectives
    return (*(DENSE + c for c in collectives), *collectives)


def choosing(spec: JobSpec) -> bool:
    """Whether the job's plan is chosen from the probes and checked in the job."""
    return (spec.collective == "auto" or spec.compression_auto) and len(plans(spec)) > 1


def payload_bytes(spec: JobSpec, numel: int) -> float:
    """One member's gradient on the wire: group-top-k at the job's density (measured on
    a sample of the vector and scaled) or the dense fp32 vector, plus a frame header."""
    if spec.compression != "group-topk" or numel == 0:
        return 4.0 * numel + HEADER_BYTES
    sample = min(numel, _MAX_SAMPLE)
    sample -= sample % spec.group_size if sample > spec.group_size else 0
    codec = GroupTopK.from_density(spec.density, spec.group_size, spec.value_dtype)  # type: ignore[arg-type]
    x = torch.randn(sample, generator=torch.Generator().manual_seed(0))
    return codec.compress(x).wire_nbytes * numel / sample + HEADER_BYTES


def workload(spec: JobSpec, numel: int) -> Workload:
    """The round's bytes: one member's payload, the dense fp32 vector, and that vector as
    a dense one-step plan sends it (`engine.reducer.Reducer.dense_wire`: the job's value
    dtype, int8 and sign as fp16)."""
    wire = BYTES_PER_VALUE[float_wire(spec.value_dtype)]
    return Workload(numel, payload_bytes(spec, numel), 4.0 * numel + HEADER_BYTES,
                    spec.topology, wire * numel + HEADER_BYTES)  # fmt: skip


def in_process_probes(world: int) -> list[Probe]:
    """`fedring simulate`'s members: this machine's codec, and no link to pay for (the
    in-process transport has neither latency nor a bandwidth limit)."""
    from fedring.compression.probe import codec_cost

    encode_s, decode_s = codec_cost()
    return [Probe(encode_s=encode_s, decode_s=decode_s)] * world


def choose_collective(spec: JobSpec, numel: int, probes: list[Probe]) -> Choice:
    """The collective alone, for the job's own codec (`fedring simulate`: in process,
    ``compression = "auto"`` runs group-top-k)."""
    if spec.compression_auto:
        spec = spec.replace(compression_auto=False)
    return choose_plan(spec, numel, probes)


def rounds_factor(spec: JobSpec, plan: str) -> float:
    """Rounds to the target of `plan` over the dense codec's, for ``spec.agents`` members:
    1 for a dense plan (and for a job that sends dense), else ``1 + (at_floor - 1) x FLOOR
    / density`` with `at_floor` `ROUNDS_AT_FLOOR` on a one-step collective, times
    ``1 + RING_STEP x (steps - RING_FREE_STEPS)`` on the bounded ring of `steps` reduce-scatter
    re-selections (N - 1 on a ring; N = 16's 2 x 2 x 4 torus makes 5) past the first
    `RING_FREE_STEPS`."""
    if codec_of(plan) == "dense" or spec.compression != "group-topk":
        return 1.0
    at_floor = ROUNDS_AT_FLOOR
    if collective_of(plan) == "ring" and spec.policy == "bounded":
        selections = steps("ring", spec.agents, spec.topology) // 2  # one per reduce-scatter step
        at_floor *= 1.0 + RING_STEP * max(selections - RING_FREE_STEPS, 0)
    density = max(float(spec.density), 1e-6)  # sparser than the floor: more rounds still
    return 1.0 + (at_floor - 1.0) * FLOOR / density


def to_target(spec: JobSpec, plan: str, allreduce_s: float, compute_s: float = 0.0) -> float:
    """A plan's time to the target, in dense rounds: its rounds factor x (the round's
    compute + its all-reduce). What `auto` compares plans by."""
    return rounds_factor(spec, plan) * (max(compute_s, 0.0) + allreduce_s)


def sent_densities(spec: JobSpec, start: int, rounds: int) -> Counter[float]:
    """How many of rounds ``[start, start + rounds)`` group-top-k sends at each density:
    the DGC warm-up's stages, the target, the closing flush (`compression.schedule`)."""
    schedule = DensitySchedule.of(float(spec.density), spec.density_warmup, spec.rounds,
                                  spec.density_flush)  # fmt: skip
    end = max(start + 1, min(start + rounds, spec.rounds))
    if schedule is None:
        return Counter({float(spec.density): end - start})
    return Counter(schedule.density(r) for r in range(start, end))


def warmup_stage(spec: JobSpec, start: int) -> tuple[JobSpec, int] | None:
    """Round `start`'s stage of the density warm-up, where it ends before the job does:
    the job as that stage sends it (the stage's density, no warm-up) and the round the
    stage ends at. None past the warm-up, without one, or in a stage the job ends in.

    The coordinator plans each such stage by itself (`coordinator.collectives`): its
    payloads are 25, 6.25 and 1.56x the target's at 1%, and fan-out's downlink carries
    N-1 of them where the ring's carries 2(N-1)/N, so the plan of the first stage is
    often not the plan of the rest (N = 8, 1 Mbit/s, the MNIST-1D CNN: the ring took
    1.3 s for the first 10 rounds, fan-out 2.8; fan-out was faster from round 10 on).
    """
    every = spec.density_warmup if spec.compression == "group-topk" else 0
    schedule = DensitySchedule(float(spec.density), steps_per_stage=every)
    end = (start // every + 1) * every if every else 0
    if not every or start < 0 or start >= schedule.warmup_steps or end >= spec.rounds:
        return None
    return spec.replace(density=schedule.density(start), density_warmup=0), end


def longest_wait(spec: JobSpec, numel: int, probes: list[Probe], plan: str, start: int) -> float:
    """The longest a member of `plan` waits on one step in round `start`, with that
    round's payloads (the density warm-up's first are up to 25x the target's): one step of
    a ring, the whole all-reduce where a member waits for it at once (fan-out's one step;
    a hub's member waits for the gather and the spread). Each step's deadline is the job's
    ``timeout_s``, which must cover this."""
    density = max(sent_densities(spec, start, 1))
    seconds = predict(plan, probes, workload(spec.replace(density=density), numel))
    if collective_of(plan) == "ring":
        return seconds / max(steps(plan, len(probes), spec.topology), 1)
    return seconds


def horizon_seconds(spec: JobSpec, numel: int, probes: list[Probe], candidates: tuple[str, ...],
                    start: int, rounds: int) -> dict[str, float]:  # fmt: skip
    """Each group-top-k plan's mean all-reduce over the `rounds` from `start` it holds
    before the job checks it: in a warm-up the payloads are 1.6 to 25x the target's, and
    fan-out's downlink carries N-1 of them where the ring's carries 2(N-1)/N, so a plan
    made for the target density alone can be the slower one for the whole of a short
    job (the 1 M-parameter MLP at 10 Mbit/s, 20 ms: 20 rounds, all in the warm-up;
    `docs/lab.md`). Empty where the job sends its target density all through."""
    sent = sent_densities(spec, start, rounds)
    if spec.compression != "group-topk" or set(sent) == {float(spec.density)}:
        return {}
    total = sum(sent.values())
    works = {d: workload(spec.replace(density=d), numel) for d in sent}  # each measured once
    return {plan: sum(n * predict(plan, probes, works[d]) for d, n in sent.items()) / total
            for plan in candidates if codec_of(plan) != "dense"}  # fmt: skip


def choose_plan(spec: JobSpec, numel: int, probes: list[Probe], compute_s: float = 0.0,
                start: int = 0, horizon: int = 0) -> Choice:  # fmt: skip
    """The job's own collective, or under ``auto`` (collective or compression) the plan
    predicted to reach the target first for `probes` (one per member, in ring order:
    rank 0 is the hub) and a round's compute of `compute_s` (`to_target`; 0: unknown):
    the coordinator's, each epoch. The choice's ``predicted_s`` stay all-reduce seconds
    at the target density; where the plan holds for `horizon` rounds from `start`
    before it is checked (the coordinator's first check), it is chosen by its mean over
    them (`horizon_seconds`: the density warm-up's payloads counted)."""
    work = workload(spec, numel)
    if not choosing(spec):
        only = plans(spec)[0]  # the job's collective ("auto" with one candidate: the ring)
        return Choice(only, {only: predict(only, probes, work)})
    candidates = plans(spec)
    choice = choose(probes, work, candidates)
    if not all(math.isfinite(v) for v in choice.predicted_s.values()):
        return choice  # the first listed (`collective.cost.choose`)
    over = horizon_seconds(spec, numel, probes, candidates, start, horizon) if horizon else {}
    choice = Choice(choice.algorithm, choice.predicted_s, over)
    time = {a: to_target(spec, a, choice.expected(a), compute_s) for a in candidates}
    best = min(candidates, key=lambda a: (time[a], candidates.index(a)))
    return Choice(best, choice.predicted_s, over)

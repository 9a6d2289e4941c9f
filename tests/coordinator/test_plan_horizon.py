"""An ``auto`` job's first plan holds until the job first checks it: through the DGC
warm-up's denser payloads and `CALIBRATION_ROUNDS` more. It is chosen by its mean
all-reduce over those rounds (`choose.horizon_seconds`), with a prior for each step's
cost the probes miss (`HOP_PRIOR_S`) until the job has measured its own."""

from __future__ import annotations

import pytest

from fedring.choose import choose_plan, horizon_seconds, sent_densities, warmup_stage
from fedring.collective.cost import Probe, hop_units, steps
from fedring.config import JobSpec
from fedring.coordinator import collectives
from fedring.coordinator.collectives import (
    CALIBRATION_ROUNDS,
    HOP_PRIOR_S,
    CollectivePlans,
    reform_seconds,
    warmup_rounds,
)
from fedring.coordinator.membership import Fleet

MEMBERS = ["a0", "a1", "a2", "a3"]
NUMEL = 1_126_410  # the digits MLP 1024x1024
# the edge lab's 10 Mbit/s, 20 ms cell as its members probed it (`docs/lab.md`)
HELLO = {"rtt_s": 0.0412, "up_bps": 828_000.0, "down_bps": 828_000.0,
         "encode_s": [1.8e-5, 9.8e-10], "decode_s": [3.6e-6, 1e-10]}  # fmt: skip


def spec(**fields: object) -> JobSpec:
    return JobSpec.from_mapping({"agents": 4, "dataset": "digits", "model": "mlp:1024x1024",
                                 "rounds": 300, "collective": "auto", **fields})  # fmt: skip


def probes() -> list[Probe]:
    return [Fleet(hellos={"a": dict(HELLO)}).cost_probe("a")] * 4


def test_the_rounds_a_first_plan_holds_are_counted_by_the_density_each_sends() -> None:
    job = spec(density=0.01, density_warmup=10)
    assert warmup_rounds(job) == 30
    assert sent_densities(job, 0, 51) == {0.25: 10, 0.0625: 10, 0.015625: 10, 0.01: 21}
    assert sent_densities(job, 60, 22) == {0.01: 22}  # a re-plan past the warm-up
    assert sent_densities(job, 295, 22) == {0.01: 5}  # not past the job's last round
    flush = spec(density=0.01, density_warmup=0, density_flush=2)
    assert sent_densities(flush, 290, 22) == {0.01: 8, 1.0: 2}
    assert horizon_seconds(job, NUMEL, probes(), ("ring", "fanout"), 60, 22) == {}


def test_a_short_jobs_first_plan_counts_the_warm_up_and_a_re_plan_past_it_does_not() -> None:
    """At the target density fan-out is predicted faster; over the warm-up's payloads
    (25% of 1.1 M entries to each of three peers) the ring is. The lab's job reached its
    target in 20 rounds, all in the warm-up: fan-out took 40.1 s, the ring 34.1."""
    job, ps = spec(density=0.01), probes()
    at_target = choose_plan(job, NUMEL, ps)
    assert at_target.algorithm == "fanout" and not at_target.horizon_s
    held = max(warmup_rounds(job), 2) + CALIBRATION_ROUNDS + 1
    first = choose_plan(job, NUMEL, ps, 0.0, 0, held)
    assert first.algorithm == "ring"
    assert first.predicted_s == at_target.predicted_s  # still the target's, for the check
    assert first.horizon_s["fanout"] > first.horizon_s["ring"] > first.predicted_s["ring"]
    assert first.to_dict()["horizon_s"] == {k: round(v, 6) for k, v in first.horizon_s.items()}
    plans, fleet = CollectivePlans(), Fleet(hellos={a: dict(HELLO) for a in MEMBERS})
    assert plans.plan(job, 0, MEMBERS, fleet, NUMEL, 0) == "ring"
    assert plans.plan(job, 1, MEMBERS, fleet, NUMEL, 100) == "fanout"  # past the warm-up


def test_the_first_plan_pays_a_prior_frame_cost_and_the_job_learns_beyond_it() -> None:
    job = spec(density=0.01, density_warmup=0)
    plans, fleet = CollectivePlans(), Fleet(hellos={a: dict(HELLO) for a in MEMBERS})
    chosen = plans.plan(job, 0, MEMBERS, fleet, NUMEL, 0)
    assert plans.hop_s == HOP_PRIOR_S and all(p.hop_s == HOP_PRIOR_S
                                              for p in plans.epochs[0].probes)  # fmt: skip
    bare = CollectivePlans(hop_prior_s=0.0)
    bare.plan(job, 0, MEMBERS, fleet, NUMEL, 0)
    n = hop_units(chosen, plans.epochs[0].probes)  # the frames on its critical path
    assert n == {"ring": 6, "fanout": 3, "hub": 4}[chosen]  # four boards: no shared cores
    priced = plans.epochs[0].choice.predicted_s[chosen]
    assert priced == pytest.approx(bare.epochs[0].choice.predicted_s[chosen] + n * HOP_PRIOR_S)
    measured = priced + n * 0.002  # each frame 2 ms over the priced one
    for r in range(3, 3 + CALIBRATION_ROUNDS):
        plans.observe(job, r, {"round": r, "comm_s": measured})
        plans.replan(job)
    assert plans.hop_s == pytest.approx(HOP_PRIOR_S + 0.002)
    quick = CollectivePlans()  # a step cheaper than the prior: learned down, not below 0
    quick.plan(job, 0, MEMBERS, fleet, NUMEL, 0)
    for r in range(3, 3 + CALIBRATION_ROUNDS):
        quick.observe(job, r, {"round": r, "comm_s": 1e-6})
        quick.replan(job)
    assert quick.hop_s == 0.0


# eight members at 1 Mbit/s each way near their broker, the MNIST-1D CNN (the edge lab's
# N = 8, 1 Mbit/s, 0 ms cell: `docs/lab.md`, sitting 23)
EIGHT = [f"a{i}" for i in range(8)]
CNN = 5210
SLOW = {"rtt_s": 0.0005, "up_bps": 125_000.0, "down_bps": 125_000.0,
        "encode_s": [2e-4, 1e-8], "decode_s": [5e-5, 2e-9]}  # fmt: skip


def walk(plans: CollectivePlans, job: JobSpec, first: int, last: int) -> dict[int, str]:
    """The head's rows `first`..`last` (no all-reduce measured): each re-plan said, by round."""
    said = {}
    for r in range(first, last + 1):
        plans.observe(job, r, {"round": r})
        if why := plans.replan(job):
            said[r] = why
    return said


def test_each_warm_up_stage_is_planned_by_itself_and_the_ring_re_forms_where_it_changes() -> None:
    """The first stage's payloads (25% of the entries) make fan-out's downlink carry seven
    of them: the ring goes first. From the third stage (1.56%) fan-out is predicted
    faster, and the job re-forms to it there, not at its first check past the warm-up."""
    job = JobSpec.from_mapping({"agents": 8, "dataset": "mnist1d", "model": "cnn",
                                "collective": "auto", "density": 0.01, "density_warmup": 10,
                                "rounds": 1000})  # fmt: skip
    plans, fleet = CollectivePlans(), Fleet(hellos={a: dict(SLOW) for a in EIGHT})
    assert plans.plan(job, 0, EIGHT, fleet, CNN, 0) == "ring"
    first = plans.epochs[0]
    assert first.until == 10 and not first.choice.horizon_s
    stage = warmup_stage(job, 0)
    assert stage is not None and stage[0].density == 0.25
    assert first.choice.predicted_s == choose_plan(stage[0], CNN, first.probes).predicted_s
    assert walk(plans, job, 1, 9) == {}
    # the second stage keeps the ring: no re-form; its predictions are the new stage's
    assert walk(plans, job, 10, 19) == {}
    assert first.until == 20 and first.choice.predicted_s["ring"] < 0.5 * (
        choose_plan(stage[0], CNN, first.probes).predicted_s["ring"])  # fmt: skip
    said = walk(plans, job, 20, 20)
    assert said[20].startswith("the warm-up stage ended at round 20: at density 0.015625 "
                               "fanout is predicted at"), said  # fmt: skip
    # the halt reached the members a round later: the re-formed epoch runs fan-out
    assert plans.plan(job, 1, EIGHT, fleet, CNN, 21) == "fanout"
    assert plans.epochs[-1].until == 30
    assert walk(plans, job, 21, 30) == {}  # the target density: fan-out still
    past = plans.epochs[-1]
    assert past.until == 0 and past.choice.algorithm == "fanout"
    at_target = choose_plan(job, CNN, past.probes)
    assert past.choice.predicted_s == at_target.predicted_s
    assert [p.until for p in plans.epochs] == [0, 0]  # nothing left to ask
    ring, fan = plans.summary(job, {}, fleet)
    assert ring["stage_density"] == 0.0625 and ring["chosen"] == "ring"
    assert ring["path_s"]["ring"] == min(ring["path_s"].values())
    assert "stage_density" not in fan and fan["chosen"] == "fanout"


def test_a_ring_re_formed_from_an_earlier_checkpoint_plans_the_stage_it_runs_again() -> None:
    """The head had reached round 25 when the ring broke; the new ring starts from the
    checkpoint of round 5: its plan is the first stage's, chosen again at round 10, not
    at once for the round the lost ring had reached."""
    job = JobSpec.from_mapping({"agents": 8, "dataset": "mnist1d", "model": "cnn",
                                "collective": "auto", "density": 0.01, "density_warmup": 10,
                                "rounds": 1000})  # fmt: skip
    plans, fleet = CollectivePlans(), Fleet(hellos={a: dict(SLOW) for a in EIGHT})
    plans.plan(job, 0, EIGHT, fleet, CNN, 20)
    plans.observe(job, 25, {"round": 25})
    assert plans.plan(job, 1, EIGHT, fleet, CNN, 5) == "ring" and plans.epochs[-1].until == 10
    assert plans.epochs[-1].density == 0.25
    assert plans.replan(job) == "" and plans.epochs[-1].density == 0.25  # not yet
    assert walk(plans, job, 6, 9) == {}
    assert walk(plans, job, 10, 10) == {} and plans.epochs[-1].until == 20


def test_a_change_of_plan_must_save_more_than_re_forming_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same eight members, each re-formation priced at 100 s: one plan runs the
    whole warm-up (no stage saves that much), and the walk through it re-forms nowhere."""
    job = JobSpec.from_mapping({"agents": 8, "dataset": "mnist1d", "model": "cnn",
                                "collective": "auto", "density": 0.01, "density_warmup": 10,
                                "rounds": 1000})  # fmt: skip
    fleet = Fleet(hellos={a: dict(SLOW) for a in EIGHT})
    cheap = CollectivePlans()
    cheap.plan(job, 0, EIGHT, fleet, CNN, 0)
    assert walk(cheap, job, 1, 30)  # as above: the ring, then fan-out from round 20
    monkeypatch.setattr(collectives, "REFORM_S", 100.0)
    assert reform_seconds(cheap.epochs[0].probes) == pytest.approx(100.0 + 4 * SLOW["rtt_s"])
    plans = CollectivePlans()
    chosen = plans.plan(job, 0, EIGHT, fleet, CNN, 0)
    assert walk(plans, job, 1, 31) == {}
    assert plans.epochs[-1].choice.algorithm == chosen and len(plans.epochs) == 1


def test_a_plan_kept_through_the_warm_up_is_checked_against_the_targets_prediction() -> None:
    """The ring holds every stage of a ring of 4; the first check past the warm-up
    compares the measured all-reduce with the target density's prediction, and learns
    the step cost beyond it (not beyond the first stage's, 25x the bytes)."""
    job = JobSpec.from_mapping({"agents": 4, "dataset": "mnist1d", "model": "cnn",
                                "collective": "auto", "density": 0.01, "density_warmup": 10,
                                "rounds": 1000})  # fmt: skip
    hello = {**SLOW, "down_bps": 60_000.0}  # `test_replan`'s: the ring first at every density
    plans = CollectivePlans(hop_prior_s=0.0)  # (with the prior, fan-out from 1.56%)
    fleet = Fleet(hellos={a: dict(hello) for a in MEMBERS})
    assert plans.plan(job, 0, MEMBERS, fleet, CNN, 0) == "ring"
    assert walk(plans, job, 1, 31) == {}
    planned = plans.epochs[0]
    assert planned.until == 0 and planned.choice.algorithm == "ring"
    target = planned.choice.predicted_s["ring"]
    assert target == choose_plan(job, CNN, planned.probes).predicted_s["ring"]
    measured = target + steps("ring", 4) * 0.002
    for r in range(32, 32 + CALIBRATION_ROUNDS):
        plans.observe(job, r, {"round": r, "comm_s": measured})
        plans.replan(job)
    assert plans.hop_s == pytest.approx(0.002)


def test_a_job_that_ends_in_a_stage_or_sends_no_warm_up_has_no_stage_to_plan() -> None:
    job = spec(density=0.01, density_warmup=10, rounds=25)
    assert warmup_stage(job, 0) == (job.replace(density=0.25, density_warmup=0), 10)
    assert warmup_stage(job, 15) == (job.replace(density=0.0625, density_warmup=0), 20)
    assert warmup_stage(job, 22) is None  # the job ends in the third stage
    assert warmup_stage(spec(density=0.01, density_warmup=10), 30) is None  # past it
    assert warmup_stage(spec(density=0.01, density_warmup=0), 0) is None
    assert warmup_stage(spec(compression="none"), 0) is None
    # a stage's own plan needs a choice: a fixed collective has no stages
    plans = CollectivePlans()
    fleet = Fleet(hellos={a: dict(HELLO) for a in MEMBERS})
    plans.plan(spec(collective="ring", density=0.01, density_warmup=10), 0, MEMBERS, fleet,
               NUMEL, 0)  # fmt: skip
    assert plans.epochs[0].until == 0

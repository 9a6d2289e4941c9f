"""An ``auto`` job's first plan holds until the job first checks it: through the DGC
warm-up's denser payloads and `CALIBRATION_ROUNDS` more. It is chosen by its mean
all-reduce over those rounds (`choose.horizon_seconds`), with a prior for each step's
cost the probes miss (`HOP_PRIOR_S`) until the job has measured its own."""

from __future__ import annotations

import pytest

from fedring.choose import choose_plan, horizon_seconds, sent_densities
from fedring.collective.cost import Probe, steps
from fedring.config import JobSpec
from fedring.coordinator.collectives import (
    CALIBRATION_ROUNDS,
    HOP_PRIOR_S,
    CollectivePlans,
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


def test_the_first_plan_pays_a_prior_step_cost_and_the_job_learns_beyond_it() -> None:
    job = spec(density=0.01, density_warmup=0)
    plans, fleet = CollectivePlans(), Fleet(hellos={a: dict(HELLO) for a in MEMBERS})
    chosen = plans.plan(job, 0, MEMBERS, fleet, NUMEL, 0)
    assert plans.hop_s == HOP_PRIOR_S and all(p.hop_s == HOP_PRIOR_S
                                              for p in plans.epochs[0].probes)  # fmt: skip
    bare = CollectivePlans(hop_prior_s=0.0)
    bare.plan(job, 0, MEMBERS, fleet, NUMEL, 0)
    n = steps(chosen, 4)
    priced = plans.epochs[0].choice.predicted_s[chosen]
    assert priced == pytest.approx(bare.epochs[0].choice.predicted_s[chosen] + n * HOP_PRIOR_S)
    measured = priced + n * 0.002  # each step 2 ms over the priced one
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

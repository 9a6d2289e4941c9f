"""``collective = "auto"`` checks its choice against the job's measured all-reduce
(`coordinator.collectives`): it learns the per-step cost the probes missed and
re-plans once another collective is expected to be at least 10% faster."""

from __future__ import annotations

from fedring.collective.cost import steps
from fedring.config import JobSpec
from fedring.coordinator.collectives import (
    CALIBRATION_ROUNDS,
    SWITCH_SHARE,
    CollectivePlans,
    warmup_rounds,
)
from fedring.coordinator.membership import Fleet

MEMBERS = ["a0", "a1", "a2", "a3"]
NUMEL = 5210  # the MNIST-1D CNN
# 1 Mbit/s up, a low probed down rate, a near broker: the model puts the ring first
HELLO = {"rtt_s": 0.0005, "up_bps": 125_000.0, "down_bps": 60_000.0,
         "encode_s": [2e-4, 1e-8], "decode_s": [5e-5, 2e-9]}  # fmt: skip


def fleet() -> Fleet:
    return Fleet(hellos={a: dict(HELLO) for a in MEMBERS})


def spec(collective: str = "auto") -> JobSpec:
    return JobSpec.from_mapping({"agents": 4, "dataset": "mnist1d", "model": "cnn",
                                 "collective": collective})  # fmt: skip


def feed(plans: CollectivePlans, job: JobSpec, first: int, comm_s: float, n: int) -> str:
    """`n` head rows from round `first` with this all-reduce; the first re-plan said."""
    for r in range(first, first + n):
        plans.observe(job, r, {"round": r, "comm_s": comm_s})
        if why := plans.replan(job):
            return why
    return ""


def test_a_ring_slower_than_predicted_per_step_re_plans_to_fanout() -> None:
    job, plans, f = spec(), CollectivePlans(), fleet()
    assert plans.plan(job, 0, MEMBERS, f, NUMEL, 0) == "ring"
    predicted = plans.epochs[0].choice.predicted_s
    assert predicted["ring"] < predicted["fanout"]
    # each of the ring's six steps costs 2 ms the probes did not see
    measured = predicted["ring"] + steps("ring", 4) * 0.002
    start = warmup_rounds(job) + 3
    why = feed(plans, job, start, measured, CALIBRATION_ROUNDS)
    assert "collective ring measured" in why and "fanout is expected" in why
    assert abs(plans.hop_s - 0.002) < 1e-9
    # the next epoch (the re-formed ring) runs fanout, predicted with the learned step
    assert plans.plan(job, 1, MEMBERS, f, NUMEL, start + CALIBRATION_ROUNDS) == "fanout"
    assert plans.epochs[-1].choice.predicted_s["fanout"] == predicted["fanout"] + 0.002
    # fanout measures as expected: the job stays
    assert feed(plans, job, start + CALIBRATION_ROUNDS + 3, predicted["fanout"] + 0.002,
                3 * CALIBRATION_ROUNDS) == ""  # fmt: skip
    [ring, fanout] = plans.summary(job, {}, f)
    assert ring["chosen"] == "ring" and fanout["chosen"] == "fanout"
    assert ring["measured_allreduce_s"] == round(measured, 6) and ring["hop_s"] == 0
    assert fanout["hop_s"] == 0.002


def test_a_good_prediction_and_a_fixed_collective_keep_their_ring() -> None:
    job, f = spec(), fleet()
    plans = CollectivePlans()
    plans.plan(job, 0, MEMBERS, f, NUMEL, 0)
    measured = plans.epochs[0].choice.predicted_s["ring"]
    assert feed(plans, job, warmup_rounds(job) + 3, measured, 3 * CALIBRATION_ROUNDS) == ""
    assert plans.hop_s == 0.0
    fixed = CollectivePlans()
    fixed.plan(spec("ring"), 0, MEMBERS, f, NUMEL, 0)
    assert feed(fixed, spec("ring"), warmup_rounds(job) + 3, 1.0, 3 * CALIBRATION_ROUNDS) == ""


def test_warm_up_rounds_and_a_new_rings_first_rounds_are_not_measured() -> None:
    job, plans = spec(), CollectivePlans()
    warm = warmup_rounds(job)
    plans.plan(job, 0, MEMBERS, fleet(), NUMEL, 0)
    assert feed(plans, job, 1, 1.0, warm) == ""  # denser payloads: skipped
    assert plans.epochs[0].comm == []
    assert feed(plans, job, warm + 1, 1.0, CALIBRATION_ROUNDS - 1) == ""  # not yet enough
    assert len(plans.epochs[0].comm) == CALIBRATION_ROUNDS - 1
    late = CollectivePlans()  # a ring re-formed at round 100: its first two rows skipped
    late.plan(job, 1, MEMBERS, fleet(), NUMEL, 100)
    assert feed(late, job, 101, 1.0, 2) == "" and late.epochs[0].comm == []


def test_measured_collectives_win_over_predictions_and_re_plans_end() -> None:
    """Fanout turns out slower than the ring measured: back to the ring, then no more."""
    job, plans, f = spec(), CollectivePlans(), fleet()
    plans.plan(job, 0, MEMBERS, f, NUMEL, 0)
    ring = plans.epochs[0].choice.predicted_s["ring"] + 6 * 0.002
    r = warmup_rounds(job) + 3
    assert feed(plans, job, r, ring, CALIBRATION_ROUNDS)
    r += CALIBRATION_ROUNDS + 1
    assert plans.plan(job, 1, MEMBERS, f, NUMEL, r) == "fanout"
    assert "fanout measured" in feed(plans, job, r + 3, 2 * ring, CALIBRATION_ROUNDS)
    r += CALIBRATION_ROUNDS + 4
    assert plans.plan(job, 2, MEMBERS, f, NUMEL, r) == "ring"  # measured, not predicted
    # two re-plans on these members (three candidates less one): no third, whatever comes
    assert feed(plans, job, r + 3, 100 * ring, 3 * CALIBRATION_ROUNDS) == ""
    assert plans.replans[tuple(MEMBERS)] == 2
    assert SWITCH_SHARE < 1

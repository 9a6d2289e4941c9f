"""``collective = "auto"`` checks its choice against the job's measured all-reduce
(`coordinator.collectives`): it learns the per-frame cost the probes missed, tries
each collective predicted within reach of the measured one (as far as the model missed
it, from `TRY_FLOOR` to `TRY_WITHIN`), and settles on the fastest measured."""

from __future__ import annotations

import pytest

from fedring.collective.cost import steps
from fedring.config import JobSpec
from fedring.coordinator.collectives import (
    CALIBRATION_ROUNDS,
    TREND_EVALS,
    TRIAL_ROUNDS,
    TRY_FLOOR,
    TRY_WITHIN,
    CollectivePlans,
    reach,
    rounds_left,
    warmup_rounds,
)
from fedring.coordinator.membership import Fleet

# Each plan here starts with no frame cost beyond the probes' (`HOP_PRIOR_S` is
# `test_plan_horizon`'s), so a test's measured excess is the frame cost it learns.
MEMBERS = ["a0", "a1", "a2", "a3"]
NUMEL = 5210  # the MNIST-1D CNN
# 1 Mbit/s up, a low probed down rate, a near broker: the model puts the ring first
HELLO = {"rtt_s": 0.0005, "up_bps": 125_000.0, "down_bps": 60_000.0,
         "encode_s": [2e-4, 1e-8], "decode_s": [5e-5, 2e-9]}  # fmt: skip


def fleet() -> Fleet:
    return Fleet(hellos={a: dict(HELLO) for a in MEMBERS})


def spec(collective: str = "auto", warmup: int = 0) -> JobSpec:
    """The job these tests check: no density warm-up unless asked, so the epoch planned
    at round 0 is the one checked (each warm-up stage has its own plan:
    `test_plan_horizon`)."""
    return JobSpec.from_mapping({"agents": 4, "dataset": "mnist1d", "model": "cnn",
                                 "collective": collective, "density": 0.01,
                                 "density_warmup": warmup})  # fmt: skip


def auto_codec() -> JobSpec:
    return JobSpec.from_mapping({"agents": 4, "dataset": "mnist1d", "model": "cnn",
                                 "compression": "auto", "density": 0.01,
                                 "density_warmup": 0})  # fmt: skip


def feed(plans: CollectivePlans, job: JobSpec, first: int, comm_s: float, n: int) -> str:
    """`n` head rows from round `first` with this all-reduce; the first re-plan said."""
    for r in range(first, first + n):
        plans.observe(job, r, {"round": r, "comm_s": comm_s})
        if why := plans.replan(job):
            return why
    return ""


def rows_from(plans: CollectivePlans) -> int:
    """The first round a freshly planned epoch measures (past the warm-up and its start)."""
    return max(warmup_rounds(spec()), plans.epochs[-1].start_round + 2) + 1


def test_a_ring_slower_than_predicted_per_frame_tries_fanout_and_keeps_it() -> None:
    job, plans, f = spec(), CollectivePlans(hop_prior_s=0.0), fleet()
    assert plans.plan(job, 0, MEMBERS, f, NUMEL, 0) == "ring"
    predicted = plans.epochs[0].choice.predicted_s
    assert predicted["ring"] < predicted["fanout"]
    # each of the ring's six steps costs 2 ms the probes did not see
    measured = predicted["ring"] + steps("ring", 4) * 0.002
    why = feed(plans, job, rows_from(plans), measured, CALIBRATION_ROUNDS)
    assert why.startswith("trying fanout:") and "ring measured" in why
    assert abs(plans.hop_s - 0.002) < 1e-9
    # the next epoch (the re-formed ring) runs fanout, predicted with the learned cost
    # of a frame: each member takes in N - 1 = 3 of them in its one step
    at = rows_from(plans) + CALIBRATION_ROUNDS
    assert plans.plan(job, 1, MEMBERS, f, NUMEL, at) == "fanout"
    fanout_s = predicted["fanout"] + 3 * 0.002
    assert plans.epochs[-1].choice.predicted_s["fanout"] == pytest.approx(fanout_s)
    # fanout measures as predicted; the hub is predicted far slower: the job stays
    assert feed(plans, job, rows_from(plans), fanout_s, 3 * CALIBRATION_ROUNDS) == ""
    assert tuple(MEMBERS) in plans.settled
    [ring, fanout] = plans.summary(job, {}, f)
    assert ring["chosen"] == "ring" and fanout["chosen"] == "fanout"
    assert ring["measured_allreduce_s"] == round(measured, 6) and ring["hop_s"] == 0
    assert fanout["hop_s"] == 0.002


def test_a_close_runner_up_is_tried_and_the_faster_measured_kept() -> None:
    """The model can over-predict too: where it missed the plan that ran by 20%, a
    runner-up within that reach is run, and the job goes back to its first choice when
    that measured faster."""
    job, plans, f = spec(), CollectivePlans(hop_prior_s=0.0), fleet()
    plans.plan(job, 0, MEMBERS, f, NUMEL, 0)
    predicted = plans.epochs[0].choice.predicted_s
    assert TRY_FLOOR * predicted["ring"] < predicted["fanout"] <= 1.2 * predicted["ring"]
    assert feed(plans, job, rows_from(plans), 1.2 * predicted["ring"], CALIBRATION_ROUNDS)
    # the ring's 20% over spread over its six frames; fan-out pays three of them
    assert plans.hop_s == pytest.approx(0.2 * predicted["ring"] / 6)
    plans.plan(job, 1, MEMBERS, f, NUMEL, 100)
    why = feed(plans, job, rows_from(plans), 2 * predicted["ring"], CALIBRATION_ROUNDS)
    assert why.startswith("back to ring:")
    assert plans.plan(job, 2, MEMBERS, f, NUMEL, 200) == "ring"  # measured, not predicted
    assert feed(plans, job, rows_from(plans), 100.0, 3 * CALIBRATION_ROUNDS) == ""  # settled


def test_a_plan_measured_as_predicted_tries_no_runner_up_predicted_slower() -> None:
    """Where the job measured its plan as the model predicted it, the model has shown
    its error on these members: a runner-up predicted 15% slower is not tried (it
    would be at `TRY_WITHIN`), and the job settles at once."""
    job, plans, f = spec(), CollectivePlans(hop_prior_s=0.0), fleet()
    plans.plan(job, 0, MEMBERS, f, NUMEL, 0)
    predicted = plans.epochs[0].choice.predicted_s
    assert TRY_FLOOR * predicted["ring"] < predicted["fanout"] <= TRY_WITHIN * predicted["ring"]
    assert feed(plans, job, rows_from(plans), 1.02 * predicted["ring"], CALIBRATION_ROUNDS) == ""
    assert tuple(MEMBERS) in plans.settled and not plans.pending


def test_the_reach_is_how_far_the_model_missed_the_plan_that_ran() -> None:
    assert reach(0.0131, 0.0125) == TRY_FLOOR  # within 5%: the floor
    assert reach(0.012, 0.010) == pytest.approx(1.2) == reach(0.010, 0.012)  # either way
    assert reach(0.0146, 0.0100) == TRY_WITHIN  # 46% off: the widest
    assert reach(0.0, 0.01) == reach(0.01, 0.0) == TRY_WITHIN  # unknown: the widest


def test_candidates_predicted_far_off_and_fixed_collectives_are_not_tried() -> None:
    job, f = spec(), fleet()
    plans = CollectivePlans(hop_prior_s=0.0)
    plans.plan(job, 0, MEMBERS, f, NUMEL, 0)
    predicted = plans.epochs[0].choice.predicted_s
    fast = predicted["fanout"] / (2 * TRY_WITHIN)  # the ring twice as fast as fanout could be
    assert feed(plans, job, rows_from(plans), fast, 3 * CALIBRATION_ROUNDS) == ""
    assert tuple(MEMBERS) in plans.settled
    fixed = CollectivePlans(hop_prior_s=0.0)
    fixed.plan(spec("ring"), 0, MEMBERS, f, NUMEL, 0)
    assert feed(fixed, spec("ring"), rows_from(fixed), 1.0, 3 * CALIBRATION_ROUNDS) == ""
    # a long compute a round brings no plan within reach: the tolerance is the all-reduce's
    slow = CollectivePlans(hop_prior_s=0.0)
    slow.plan(job, 0, MEMBERS, f, NUMEL, 0)
    first = rows_from(slow)
    for r in range(first, first + 3 * CALIBRATION_ROUNDS):
        slow.observe(job, r, {"round": r, "comm_s": fast, "compute_s": 1.0})
        assert slow.replan(job) == ""


def test_a_long_compute_makes_the_rounds_decide_and_fanout_is_tried_at_n8() -> None:
    """In a ring of 8 the bounded ring re-selects seven times and needs more rounds than
    fan-out (`choose.rounds_factor`): where a round computes for a second, a ring twice as
    fast an all-reduce as fan-out could be still reaches the target later, and fan-out is
    tried. In a ring of 4 the same measurement keeps the ring (the previous test)."""
    eight = [f"a{i}" for i in range(8)]
    job = spec().replace(agents=8)
    plans = CollectivePlans(hop_prior_s=0.0)
    assert plans.plan(job, 0, eight, Fleet(hellos={a: dict(HELLO) for a in eight}), NUMEL,
                      0) == "ring"  # fmt: skip
    fast = plans.epochs[0].choice.predicted_s["fanout"] / (2 * TRY_WITHIN)
    first, said = rows_from(plans), ""
    for r in range(first, first + CALIBRATION_ROUNDS):
        plans.observe(job, r, {"round": r, "comm_s": fast, "compute_s": 1.0})
        said = said or plans.replan(job)
    assert said.startswith("trying fanout:"), said


def test_warm_up_rounds_and_a_new_rings_first_rounds_are_not_measured() -> None:
    job, plans = spec(warmup=10), CollectivePlans(hop_prior_s=0.0)
    warm = warmup_rounds(job)
    plans.plan(job, 0, MEMBERS, fleet(), NUMEL, 0)
    assert feed(plans, job, 1, 1.0, warm) == ""  # denser payloads: skipped
    assert plans.epochs[0].comm == []
    assert feed(plans, job, warm + 1, 1.0, CALIBRATION_ROUNDS - 1) == ""  # not yet enough
    assert len(plans.epochs[0].comm) == CALIBRATION_ROUNDS - 1
    late = CollectivePlans(
        hop_prior_s=0.0
    )  # a ring re-formed at round 100: its first two rows skipped
    late.plan(job, 1, MEMBERS, fleet(), NUMEL, 100)
    assert feed(late, job, 101, 1.0, 2) == "" and late.epochs[0].comm == []
    # a dense plan sends no warm-up's denser payloads: measured from its third round
    dense = JobSpec.from_mapping({"agents": 4, "dataset": "mnist1d", "model": "cnn",
                                  "compression": "auto"})  # fmt: skip
    gbit = {**HELLO, "up_bps": 1.25e8, "down_bps": 1.25e8, "encode_s": [2e-4, 4e-6]}
    fast = Fleet(hellos={a: dict(gbit) for a in MEMBERS})
    first = CollectivePlans(hop_prior_s=0.0)
    first.plan(dense, 0, MEMBERS, fast, NUMEL, 0)
    assert first.codec() == "dense" and warmup_rounds(dense) > 3
    feed(first, dense, 1, 1.0, 3)
    assert len(first.epochs[0].comm) == 1  # round 3 on


def test_every_candidate_runs_at_most_once_before_the_members_settle() -> None:
    """Whatever is measured, three candidates give at most three re-plans: two tries
    and one settling."""
    job, plans, f = spec(), CollectivePlans(hop_prior_s=0.0), fleet()
    algorithm, said = plans.plan(job, 0, MEMBERS, f, NUMEL, 0), []
    for epoch in range(1, 10):
        slow = plans.epochs[-1].choice.predicted_s["hub"] * 3  # nothing is ever fast
        if why := feed(plans, job, rows_from(plans), slow / epoch, CALIBRATION_ROUNDS):
            said.append(why)
            algorithm = plans.plan(job, epoch, MEMBERS, f, NUMEL, 100 * epoch)
    assert len(said) <= 3 and tuple(MEMBERS) in plans.settled
    assert set(plans.measured[tuple(MEMBERS)]) == {"ring", "fanout", "hub"}
    best = min(plans.measured[tuple(MEMBERS)].items(), key=lambda kv: kv[1])[0]
    assert algorithm == best


def test_compression_auto_tries_dense_when_group_topk_measures_slow_and_keeps_it() -> None:
    """``compression = "auto"``: the dense ring is a plan like a collective. Group-top-k
    measured far slower than predicted (its CPU under load), the dense ring comes within
    reach and is tried; measured faster, the job keeps it: the manifests say "dense",
    the rows and the summary name the codec."""
    job = auto_codec()
    plans, f = CollectivePlans(hop_prior_s=0.0), fleet()
    assert plans.plan(job, 0, MEMBERS, f, NUMEL, 0) == "ring" and plans.codec() == ""
    predicted = plans.epochs[0].choice.predicted_s
    assert set(predicted) == {"dense ring", "ring"} and predicted["ring"] < predicted["dense ring"]
    assert plans.tag({"round": 1})["codec"] == "group-topk"
    slow = 4 * (predicted["dense ring"] - predicted["ring"]) + predicted["ring"]
    why = feed(plans, job, rows_from(plans), slow, CALIBRATION_ROUNDS)
    assert why.startswith("trying dense ring:"), why
    at = rows_from(plans) + CALIBRATION_ROUNDS
    assert plans.plan(job, 1, MEMBERS, f, NUMEL, at) == "ring" and plans.codec() == "dense"
    assert plans.tag({"round": at})["codec"] == "dense"
    assert feed(plans, job, rows_from(plans), slow / 2, 3 * CALIBRATION_ROUNDS) == ""
    assert tuple(MEMBERS) in plans.settled and plans.codec() == "dense"
    [first, second] = plans.summary(job, {}, f)
    assert (first["chosen"], first["codec"]) == ("ring", "group-topk")
    assert (second["chosen"], second["codec"]) == ("dense ring", "dense")


# the head's evaluations of the digits MLP at N = 8, 50 Mbit/s (the grid, sitting 24):
# group-top-k fan-out reached its target, 0.95, at round 55
DIGITS = [(30, 0.886), (35, 0.925), (40, 0.944), (45, 0.939), (50, 0.942)]


def test_rounds_left_follows_the_accuracys_trend_to_the_target() -> None:
    job = JobSpec.from_mapping({"agents": 8, "dataset": "digits", "rounds": 400,
                                "target_accuracy": 0.95})  # fmt: skip
    # the line through the five: 0.00252 a round, 0.9524 at round 50: already there
    assert rounds_left(job, 50, DIGITS) == 0.0
    assert abs(rounds_left(job, 50, [(30, 0.80), (40, 0.85), (50, 0.90)]) - 10.0) < 1e-9
    slow = [(30, 0.80), (40, 0.81), (50, 0.82)]  # 130 rounds to the target on this trend
    assert rounds_left(job.replace(rounds=60), 50, slow) == 10.0  # its last round first
    # nothing said: falling or flat accuracy, too few evaluations, no target, no stop
    assert rounds_left(job, 50, [(30, 0.90), (40, 0.89), (50, 0.88)]) == 350.0
    assert rounds_left(job, 50, [(30, 0.90), (40, 0.90), (50, 0.90)]) == 350.0
    assert rounds_left(job, 50, DIGITS[-2:]) == 350.0
    assert rounds_left(job.replace(target_accuracy=0.0), 50, DIGITS) == 350.0
    assert rounds_left(job.replace(aggregation="hybrid"), 50, DIGITS) == 350.0
    assert rounds_left(job, 40, DIGITS) == rounds_left(job, 40, DIGITS[:3])  # past `now`: not seen


def test_the_head_evaluations_kept_are_the_newest_few() -> None:
    """A long job evaluating every round keeps a handful, not one a round; a ring
    re-formed from an earlier round drops those past it."""
    job = auto_codec().replace(target_accuracy=0.95, rounds=100_000)
    plans = CollectivePlans(hop_prior_s=0.0)
    plans.plan(job, 0, MEMBERS, fleet(), NUMEL, 0)
    for r in range(1, 10_001):
        plans.observe(job, r, {"round": r, "accuracy": r / 20_000})
    assert len(plans.evals) <= TREND_EVALS + 1 and plans.evals[-1] == (10_000, 0.5)
    plans.observe(job, 9_998, {"round": 9_998, "accuracy": 0.25})  # from an earlier round
    assert [r for r, _ in plans.evals] == [9_996, 9_997, 9_998]


def test_compression_auto_tries_nothing_the_job_would_end_during() -> None:
    """The same slow group-top-k that would try the dense ring (the test above), in a job
    whose accuracy nears its target: a trial runs `TRIAL_ROUNDS` before it is measured,
    the job likely ends first, so the plan is kept and the summary says what was not
    tried (the grid's digits MLP at N = 8, 50 Mbit/s tried dense fan-out at round 50,
    lost accuracy on the switch and reached 0.95 at round 75 where its fan-out did at 55)."""
    job = auto_codec().replace(target_accuracy=0.95, rounds=400)
    plans, f = CollectivePlans(hop_prior_s=0.0), fleet()
    assert plans.plan(job, 0, MEMBERS, f, NUMEL, 0) == "ring"
    predicted = plans.epochs[0].choice.predicted_s
    slow = 4 * (predicted["dense ring"] - predicted["ring"]) + predicted["ring"]
    for r, accuracy in DIGITS:  # the head's evaluation rows, before the check
        plans.observe(job, r, {"round": r, "accuracy": accuracy})
    assert feed(plans, job, 51, slow, CALIBRATION_ROUNDS) == ""
    assert plans.pending == "" and tuple(MEMBERS) in plans.settled and plans.codec() == ""
    [epoch] = plans.summary(job, {}, f)
    assert epoch["not_tried"] == {"plan": "dense ring", "rounds_left": 0.0}
    # far from the target (accuracy 0.5 and rising slowly) the trial is worth its rounds
    far = CollectivePlans(hop_prior_s=0.0)
    far.plan(job, 0, MEMBERS, f, NUMEL, 0)
    for r in (30, 40, 50):
        far.observe(job, r, {"round": r, "accuracy": 0.4 + r / 500})
    assert rounds_left(job, 70, far.evals) > TRIAL_ROUNDS
    assert feed(far, job, 51, slow, CALIBRATION_ROUNDS).startswith("trying dense ring:")


def test_compression_auto_goes_back_to_group_topk_when_dense_measures_slower() -> None:
    job = auto_codec()
    plans, f = CollectivePlans(hop_prior_s=0.0), fleet()
    plans.plan(job, 0, MEMBERS, f, NUMEL, 0)
    predicted = plans.epochs[0].choice.predicted_s
    slow = 4 * (predicted["dense ring"] - predicted["ring"]) + predicted["ring"]
    assert feed(plans, job, rows_from(plans), slow, CALIBRATION_ROUNDS)
    at = rows_from(plans) + CALIBRATION_ROUNDS
    plans.plan(job, 1, MEMBERS, f, NUMEL, at)
    why = feed(plans, job, rows_from(plans), slow * 2, CALIBRATION_ROUNDS)
    assert why.startswith("back to ring:"), why
    plans.plan(job, 2, MEMBERS, f, NUMEL, at + 2 * CALIBRATION_ROUNDS)
    assert plans.codec() == "" and plans.epochs[-1].choice.algorithm == "ring"


def test_a_job_without_compression_auto_has_no_codec_in_its_rows() -> None:
    plans = CollectivePlans(hop_prior_s=0.0)
    plans.plan(spec("ring"), 0, MEMBERS, fleet(), NUMEL, 0)
    assert "codec" not in plans.tag({"round": 1}) and plans.codec() == ""
    assert "codec" not in plans.summary(spec("ring"), {}, fleet())[0]


def test_compression_auto_tries_dense_when_group_topk_cpu_may_explain_the_excess() -> None:
    """Measured 4x its prediction, group-top-k's excess spread over the ring's steps
    would put the dense ring out of reach; but the excess may be group-top-k's own CPU,
    which dense does not pay: judged without it, dense is within reach and tried."""
    job = auto_codec()
    # 20 Mbit/s both ways, group-top-k at 4e-7 s an entry (the loaded sandbox's codec_cost)
    hello = {**HELLO, "up_bps": 2.5e6, "down_bps": 2.5e6, "encode_s": [2e-4, 4e-7]}
    plans, f = CollectivePlans(hop_prior_s=0.0), Fleet(hellos={a: dict(hello) for a in MEMBERS})
    assert plans.plan(job, 0, MEMBERS, f, NUMEL, 0) == "ring" and plans.codec() == ""
    predicted = plans.epochs[0].choice.predicted_s
    measured = 4 * predicted["ring"]  # as the grid measured `auto` under load
    assert predicted["dense ring"] <= TRY_WITHIN * measured  # in reach without the excess
    assert predicted["dense ring"] + (measured - predicted["ring"]) > TRY_WITHIN * measured
    why = feed(plans, job, rows_from(plans), measured, CALIBRATION_ROUNDS)
    assert why.startswith("trying dense ring:"), why


def test_compression_auto_weighs_the_measured_compute_with_group_topks_extra_rounds() -> None:
    """Group-top-k's all-reduce measures as predicted, shorter than the dense ring's; but
    the head's rows say a round computes for 30 ms, and group-top-k needs more rounds to
    the target (`choose.rounds_factor`): the dense ring reaches it first and is tried.
    Once the members' acks report that step, the next plan starts dense."""
    job = auto_codec()
    hello = {**HELLO, "up_bps": 6.25e6, "down_bps": 6.25e6}  # 50 Mbit/s
    plans, f = CollectivePlans(hop_prior_s=0.0), Fleet(hellos={a: dict(hello) for a in MEMBERS})
    assert plans.plan(job, 0, MEMBERS, f, NUMEL, 0) == "ring" and plans.codec() == ""
    predicted = plans.epochs[0].choice.predicted_s
    assert predicted["ring"] < predicted["dense ring"]
    first = rows_from(plans)
    for r in range(first, first + CALIBRATION_ROUNDS):
        plans.observe(job, r, {"round": r, "comm_s": predicted["ring"], "compute_s": 0.03})
        why = plans.replan(job)
    assert why.startswith("trying dense ring:"), why
    # without the compute the same measurement keeps group-top-k
    bare = CollectivePlans(hop_prior_s=0.0)
    bare.plan(job, 0, MEMBERS, f, NUMEL, 0)
    assert feed(bare, job, rows_from(bare), predicted["ring"], CALIBRATION_ROUNDS) == ""
    # a fresh job whose members acked a 30 ms step plans the dense ring at once
    acked = Fleet(hellos={a: dict(hello) for a in MEMBERS})
    for a in MEMBERS:
        acked.on_ack(a, {"step_s": 0.03})
    fresh = CollectivePlans(hop_prior_s=0.0)
    assert fresh.plan(job, 0, MEMBERS, acked, NUMEL, 0) == "ring" and fresh.codec() == "dense"


def test_the_predicted_round_counts_the_members_checkpoint_patches_not_a_whole_upload() -> None:
    """With the checkpoint stream the head waits for the members' patches of their
    slices (a third of the model each in a ring of 4), not for its own whole upload;
    the ``hybrid`` rule keeps the whole upload. The head runs one checkpoint ahead, so
    a round pays only the part of that wait its own round does not cover."""
    job = spec("ring").replace(checkpoint_every=1)
    plans, f = CollectivePlans(hop_prior_s=0.0), fleet()
    plans.plan(job, 0, MEMBERS, f, NUMEL, 0)
    [epoch] = plans.summary(job, {}, f)
    allreduce = epoch["predicted_s"]["ring"]
    slice_up = HELLO["rtt_s"] + 4 * NUMEL / 3 / HELLO["up_bps"]
    assert slice_up > allreduce  # else the wait would be hidden whole: nothing to check
    assert abs(epoch["predicted_round_s"] - slice_up) < 2e-6  # allreduce + (slice_up - it)
    hybrid = job.replace(aggregation="hybrid:1")
    [whole] = plans.summary(hybrid, {}, f)
    assert (
        whole["predicted_round_s"]
        > epoch["predicted_round_s"] + 2 * 4 * NUMEL / 3 / HELLO["up_bps"] - 1e-6
    )
    # every 4 rounds: the wait overlaps 4 rounds, and what is left is spread over them
    [four] = plans.summary(job.replace(checkpoint_every=4), {}, f)
    assert abs(four["predicted_round_s"] - (allreduce + (slice_up - 4 * allreduce) / 4)) < 2e-6
    [eight] = plans.summary(job.replace(checkpoint_every=8), {}, f)  # hidden whole
    assert 8 * allreduce > slice_up and abs(eight["predicted_round_s"] - allreduce) < 2e-6

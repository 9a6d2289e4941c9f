"""A re-plan re-forms the same ring in the halted ring's order (`epoch.same_order`):
`CollectivePlans` keys what it measured, and honours the trial it asked for, by the
member list in order, so a ring in the fleet's new order would forget both."""

from __future__ import annotations

from fedring.collective.cost import steps
from fedring.coordinator.collectives import CALIBRATION_ROUNDS, CollectivePlans
from fedring.coordinator.epoch import same_order
from tests.coordinator.test_replan import MEMBERS, NUMEL, feed, fleet, rows_from, spec


def test_the_kept_order_runs_the_trial_asked_for_and_settles_on_one_key() -> None:
    job, plans, f = spec(), CollectivePlans(hop_prior_s=0.0), fleet()
    assert plans.plan(job, 0, MEMBERS, f, NUMEL, 0) == "ring"
    predicted = plans.epochs[0].choice.predicted_s
    measured = predicted["ring"] + steps("ring", 4) * 0.002
    assert feed(plans, job, rows_from(plans), measured, CALIBRATION_ROUNDS).startswith(
        "trying fanout:"
    )
    moved = list(reversed(MEMBERS))  # the fleet's order once the acks' steps came in
    # in the halted ring's order: fanout is tried, measured, and the job settles
    kept = same_order(moved, plans.epochs[-1].members)
    assert kept == MEMBERS
    assert plans.plan(job, 1, kept, f, NUMEL, 40) == "fanout"
    assert (
        feed(plans, job, rows_from(plans), predicted["fanout"] + 0.002, 3 * CALIBRATION_ROUNDS)
        == ""
    )
    assert set(plans.measured) == {tuple(MEMBERS)} and plans.settled == {tuple(MEMBERS)}
    assert set(plans.measured[tuple(MEMBERS)]) == {"ring", "fanout"}

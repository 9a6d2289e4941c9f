"""Aggregation rules on tiny hand-written arrays."""

from __future__ import annotations

import pytest
import torch

from fedring.aggregation import (
    Aggregation,
    capped_weights,
    hybrid,
    mean,
    median,
    sign_vote,
    trimmed_mean,
    weighted,
)

U = torch.tensor([[1.0, -2.0, 0.0], [3.0, 0.0, 0.0], [100.0, 1.0, -1.0], [2.0, -1.0, 1.0]])


def test_mean_is_dragged_by_one_outlier_median_and_trimmed_are_not() -> None:
    assert mean(U).tolist() == [26.5, -0.5, 0.0]
    assert median(U).tolist() == [2.0, -1.0, 0.0]
    assert trimmed_mean(U, 0.25).tolist() == [2.5, -0.5, 0.0]
    assert torch.equal(trimmed_mean(U, 0.0), mean(U))


def test_sign_vote_is_the_majority_and_ties_give_zero() -> None:
    assert sign_vote(U).tolist() == [1.0, -1.0, 0.0]


def test_weights_follow_sizes_but_are_capped() -> None:
    w = capped_weights([10, 10, 10, 70], cap=1.5)
    assert torch.allclose(w.sum(), torch.tensor(1.0))
    assert float(w[3]) == pytest.approx(1.5 / 4)
    assert torch.allclose(w[:3], w[0].expand(3))
    assert capped_weights([5, 5], cap=2.0).tolist() == [0.5, 0.5]
    assert weighted(U[:2], torch.tensor([0.25, 0.75])).tolist() == [2.5, -0.5, 0.0]


def test_hybrid_mixes_and_schedules_lambda() -> None:
    g, local = torch.tensor([1.0]), torch.tensor([3.0])
    assert hybrid(g, local, 0.25).tolist() == [2.5]
    agg = Aggregation.parse("hybrid:0.9-0.5")
    assert agg.lam(0, 11) == pytest.approx(0.9) and agg.lam(10, 11) == pytest.approx(0.5)
    assert Aggregation.parse("hybrid:0.3").lam(5, 10) == 0.3


@pytest.mark.parametrize(
    ("spec", "message"),
    [("avg", "not one of"), ("hybrid:2", "in \\[0, 1\\]"), ("hybrid:x", "number"),
     ("trimmed:0.5", "0.5\\)"), ("mean:1", "no argument")],
)  # fmt: skip
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Aggregation.parse(spec)


def test_which_rules_average_and_which_need_a_star() -> None:
    assert Aggregation.parse("weighted").averaged and not Aggregation.parse("vote").averaged
    assert Aggregation.parse("trimmed:0.2").needs_star and not Aggregation.parse("mean").needs_star

"""Aggregation rules on tiny hand-written arrays."""

from __future__ import annotations

import pytest
import torch

from fedring.aggregation import (
    Aggregation,
    aligned,
    capped_weights,
    centred_clip,
    hybrid,
    mean,
    median,
    robust,
    sign_vote,
    trimmed_mean,
    weighted,
)

U = torch.tensor([[1.0, -2.0, 0.0], [3.0, 0.0, 0.0], [100.0, 1.0, -1.0], [2.0, -1.0, 1.0]])


def test_mean_is_dragged_by_one_outlier_median_and_trimmed_are_not() -> None:
    assert mean(U).tolist() == [26.5, -0.5, 0.0]
    assert median(U).tolist() == [2.5, -0.5, 0.0]
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


def test_the_median_of_an_even_count_is_the_mean_of_the_two_middles() -> None:
    assert median(torch.tensor([[1.0], [2.0], [4.0], [100.0]])).tolist() == [3.0]
    assert median(torch.tensor([[1.0], [2.0], [100.0]])).tolist() == [2.0]
    assert median(U).tolist() == [2.5, -0.5, 0.0]  # unbiased: not the lower middle


def test_the_robust_rules_are_averaged_and_need_a_star_the_vote_is_neither() -> None:
    for spec in ("median", "trimmed:0.25", "clip", "clip:0.5"):
        rule = Aggregation.parse(spec)
        assert rule.averaged and rule.robust and rule.needs_star, spec
    for spec in ("mean", "weighted", "hybrid:0.5"):
        rule = Aggregation.parse(spec)
        assert rule.averaged and not rule.robust and not rule.needs_star, spec
    assert not Aggregation.parse("vote").averaged


def test_clip_parses_a_fixed_radius_or_none() -> None:
    assert Aggregation.parse("clip").tau == 0.0
    assert Aggregation.parse("clip:2.5").tau == 2.5
    for bad in ("clip:0", "clip:-1", "clip:x", "clip:inf"):
        with pytest.raises(ValueError, match="TAU"):
            Aggregation.parse(bad)


def test_centred_clipping_moves_by_the_clipped_mean_from_its_centre() -> None:
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    # one iteration from 0 with radius 1: (clip([3, 4]) + 0) / 2 = [0.3, 0.4]
    got = centred_clip(x, tau=1.0, iters=1, centre=torch.zeros(2))
    assert torch.allclose(got, torch.tensor([0.3, 0.4]))
    # a radius beyond every distance: the plain mean, from any centre
    assert torch.allclose(centred_clip(x, tau=100.0, iters=1, centre=torch.ones(2)), mean(x))


def test_centred_clipping_bounds_an_outlier_and_adapts_its_radius() -> None:
    honest = torch.tensor([[1.0, 2.0], [1.2, 1.8], [0.8, 2.2]])
    for outlier in ([-1e4, 1e4], [1e6, 0.0]):
        x = torch.cat([honest, torch.tensor([outlier])])
        got = centred_clip(x)
        assert float(torch.linalg.vector_norm(got - honest.mean(dim=0))) < 0.5, outlier
    # all alike: the common value itself
    same = torch.tensor([[1.0, -1.0]] * 4)
    assert centred_clip(same).tolist() == [1.0, -1.0]
    assert robust(x, Aggregation.parse("clip")).tolist() == got.tolist()
    assert robust(U, Aggregation.parse("median")).tolist() == median(U).tolist()
    with pytest.raises(ValueError, match="not a robust rule"):
        robust(U, Aggregation.parse("mean"))


def test_aligned_drops_updates_pointing_away_but_never_more_than_half() -> None:
    honest = torch.tensor([[1.0, 0.5, 0.2], [0.8, 0.7, -0.1], [1.2, 0.3, 0.1]])
    flipped = -3.0 * honest[:1]
    x = torch.cat([honest, flipped])
    assert torch.equal(aligned(x, median(x)), honest)
    # most point away from the reference: the half most aligned stays
    ref = torch.tensor([1.0, 0.0, 0.0])
    away = torch.tensor([[-1.0, 0, 0], [-2.0, 0, 0], [-0.5, 1, 0], [1.0, 0, 0]])
    assert aligned(away, ref).tolist() == [[-0.5, 1.0, 0.0], [1.0, 0.0, 0.0]]
    # the clip rule aligns first: a flipped update ten times as large leaves no trace
    got = robust(torch.cat([honest, 10 * flipped]), Aggregation.parse("clip"))
    assert torch.allclose(got, centred_clip(honest, centre=median(torch.cat([honest,
                                                                 10 * flipped]))))  # fmt: skip

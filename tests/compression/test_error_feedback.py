"""ErrorFeedback: nothing is lost over many steps; state survives a weights-only load."""

from __future__ import annotations

import io

import pytest
import torch

from fedring.compression import ErrorFeedback, GroupTopK


def test_sent_plus_residual_accounts_for_every_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    ef, topk = ErrorFeedback(1000), GroupTopK(100, 2)
    total_grad, total_sent = (
        torch.zeros(1000, dtype=torch.float64),
        torch.zeros(1000, dtype=torch.float64),
    )
    for _ in range(50):
        g = torch.randint(-64, 65, (1000,), generator=gen).float() / 8  # sums stay exact
        total_grad += g.double()
        sent = topk.compress(ef.compensate(g))
        ef.update(sent)
        total_sent += sent.decompress().double()
    assert torch.equal(total_sent + ef.residual.double(), total_grad)


def test_without_feedback_mass_is_lost_with_it_nothing_is() -> None:
    g = torch.tensor([3.0, 1.0, 1.0, 1.0])
    ef, topk = ErrorFeedback(4), GroupTopK(4, 1)
    sent_total = torch.zeros(4)
    for _ in range(10):
        sent = topk.compress(ef.compensate(g))
        ef.update(sent)
        sent_total += sent.decompress()
    # the small entries are eventually sent, not silently dropped
    assert bool((sent_total[1:] > 0).all())


def test_state_dict_round_trips_through_weights_only_load() -> None:
    ef = ErrorFeedback(10, momentum=0.9)
    ef.compensate(torch.arange(10.0))
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    other = ErrorFeedback(10, momentum=0.9)
    other.load_state_dict(state)
    assert torch.equal(other.residual, ef.residual)
    assert other.velocity is not None and ef.velocity is not None
    assert torch.equal(other.velocity, ef.velocity)


def test_load_refuses_a_state_of_another_shape() -> None:
    with pytest.raises(ValueError, match=r"expected \(5,\)"):
        ErrorFeedback(5).load_state_dict(ErrorFeedback(6).state_dict())
    with pytest.raises(ValueError, match="momentum"):
        ErrorFeedback(5).load_state_dict(ErrorFeedback(5, momentum=0.5).state_dict())


def test_dgc_momentum_correction_masks_sent_entries() -> None:
    ef, topk = ErrorFeedback(4, momentum=0.5), GroupTopK(4, 1)
    g = torch.tensor([4.0, 1.0, 0.5, 0.25])
    sent = topk.compress(ef.compensate(g))
    ef.update(sent)
    assert ef.velocity is not None
    assert ef.velocity.tolist() == [0.0, 1.0, 0.5, 0.25]  # cleared where sent
    v2 = ef.compensate(g)  # u = 0.5 u + g ; v += u
    assert v2.tolist() == [4.0, 1.0 + 1.5, 0.5 + 0.75, 0.25 + 0.375]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="numel"):
        ErrorFeedback(0)
    with pytest.raises(ValueError, match="momentum"):
        ErrorFeedback(3, momentum=1.0)
    with pytest.raises(ValueError, match="4 entries"):
        ErrorFeedback(3).compensate(torch.zeros(4))


def test_load_refuses_a_velocity_of_another_shape() -> None:
    state = ErrorFeedback(5, momentum=0.5).state_dict()
    state["velocity"] = torch.tensor([7.0])
    with pytest.raises(ValueError, match="velocity"):
        ErrorFeedback(5, momentum=0.5).load_state_dict(state)

"""The run's clock: process one-offs and the plan are `setup_seconds`, apart from
`wall_seconds`, and paying the one-offs first changes no result."""

from __future__ import annotations

import torch

from fedring.config import JobSpec
from fedring.sim.runner import pay_process_one_offs, simulate


def test_paying_the_one_offs_draws_no_random_numbers() -> None:
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    pay_process_one_offs()
    assert torch.equal(torch.rand(4), expected)


def test_setup_is_reported_apart_from_the_run_and_the_hash_does_not_move() -> None:
    spec = JobSpec(agents=2, rounds=10, eval_every=10)
    first = simulate(spec)
    pay_process_one_offs()  # a second time: as a later job in the process finds it
    again = simulate(spec)
    for s in (first, again):
        assert s["setup_seconds"] > 0 and s["wall_seconds"] > 0
    assert first["model_hashes"] == again["model_hashes"]
    assert first["bytes_sent_per_agent"] == again["bytes_sent_per_agent"]

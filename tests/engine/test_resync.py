"""The mixed-architecture re-sync: a drifting member is measured and brought back.

A real aarch64 board cannot run here, so one member's parameters are nudged by
about 1e-7 before every round (`simulate(perturb=...)`), the size of the
differences seen between x86_64 and aarch64 torch.
"""

from __future__ import annotations

import pytest
import torch

from fedring.config import JobSpec, SpecError
from fedring.engine.resync import Drift, ResyncSettings, resync_every, summarise
from fedring.sim.runner import simulate

SMALL = {"agents": 3, "rounds": 60, "eval_every": 10}


def nudge(rank_to_nudge: int, scale: float = 1e-7):  # type: ignore[no-untyped-def]
    """A stand-in for a member on another architecture: seeded noise of `scale`."""

    def perturb(rank: int, rnd: int, model: torch.nn.Module) -> None:
        if rank != rank_to_nudge:
            return
        gen = torch.Generator().manual_seed(1000 + rnd)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * scale)

    return perturb


def test_due_every_k_rounds_and_at_the_last() -> None:
    s = ResyncSettings(every=20)
    assert [r for r in range(50) if s.due(r, 50)] == [19, 39, 49]
    assert not any(ResyncSettings().due(r, 50) for r in range(50))


def test_policy_mixed_resyncs_only_a_mixed_fleet() -> None:
    assert resync_every("mixed", 50, mixed=False) == 0
    assert resync_every("mixed", 50, mixed=True) == 50
    assert resync_every("always", 7, mixed=False) == 7
    assert resync_every("never", 50, mixed=True) == 0
    with pytest.raises(ValueError, match="sometimes"):
        resync_every("sometimes", 50, mixed=True)


def test_bad_resync_fields_are_refused_by_name() -> None:
    with pytest.raises(SpecError, match="'resync'='sometimes'"):
        JobSpec(resync="sometimes")
    with pytest.raises(SpecError, match="'resync_every'=0"):
        JobSpec(resync_every=0)


def test_summary_keeps_the_largest_drift_per_member() -> None:
    out = summarise(
        [("a", 10, Drift(1e-7, 2e-6)), ("a", 20, Drift(3e-7, 1e-6)), ("b", 10, Drift(0, 0))],
        every=10,
    )
    assert out["resyncs"] == 2 and out["max_abs"] == 3e-7 and out["l2"] == 2e-6
    assert out["by_member"] == {"a": {"max_abs": 3e-7, "l2": 2e-6}, "b": {"max_abs": 0, "l2": 0}}


def test_a_drifting_member_without_resync_ends_with_another_model() -> None:
    s = simulate(JobSpec(**SMALL, resync="never"), perturb=nudge(2))
    assert not s["identical_models"] and len(s["model_hashes"]) == 2
    assert s["drift"]["resyncs"] == 0


def test_resync_measures_the_drift_and_ends_in_lock_step() -> None:
    clean = simulate(JobSpec(**SMALL, resync="never"))
    s = simulate(JobSpec(**SMALL, resync="always", resync_every=20), perturb=nudge(2))
    assert s["identical_models"], s["model_hashes"]
    d = s["drift"]
    assert d["resync_every"] == 20 and d["resyncs"] == 3  # rounds 20, 40, 60
    members = d["by_member"]
    assert members["agent-0"] == {"max_abs": 0.0, "l2": 0.0}  # the head
    assert members["agent-1"] == {"max_abs": 0.0, "l2": 0.0}  # same bits as the head
    assert 1e-8 < members["agent-2"]["max_abs"] < 1e-4, members
    assert members["agent-2"]["l2"] >= members["agent-2"]["max_abs"]
    resynced = [row["round"] for row in s["rows"] if row.get("resynced")]
    assert resynced == [20, 40, 60]
    assert abs(s["final_accuracy"] - clean["final_accuracy"]) < 0.03


def test_one_architecture_never_resyncs_and_keeps_its_hash() -> None:
    """The default policy ("mixed") in a fleet of one architecture is a job without it."""
    default = simulate(JobSpec(**SMALL))
    never = simulate(JobSpec(**SMALL, resync="never"))
    assert default["model_hashes"] == never["model_hashes"]
    assert default["bytes_sent_per_agent"] == never["bytes_sent_per_agent"]
    assert default["drift"]["resyncs"] == 0


def test_resync_of_identical_members_changes_no_bit() -> None:
    """x + 0.0 is x: a re-sync of members that agree leaves the hash as it was."""
    always = simulate(JobSpec(**SMALL, resync="always", resync_every=10))
    never = simulate(JobSpec(**SMALL, resync="never"))
    assert always["model_hashes"] == never["model_hashes"]
    assert always["drift"]["resyncs"] == 6 and always["drift"]["max_abs"] == 0.0

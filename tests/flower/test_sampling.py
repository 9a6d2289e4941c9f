"""Client sampling in fedring's ServerApp: the seeded sample trains, the rest sit out
and come back with the whole model; the residual policy; the job's checks."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from fedring.config import JobSpec, SpecError
from fedring.engine.participation import SitOut, per_round, sampled
from fedring.flower.client_app import app as client_app
from fedring.flower.job import FlowerJob
from fedring.flower.node import enrol, train_round
from fedring.flower.server_app import run_job
from fedring.sim.runner import plan
from tests.flower.inproc_grid import InProcessGrid

SPEC = JobSpec(agents=6, dataset="digits", topology="star", sync="local", local_steps=2,
               lr=0.05, rounds=6, eval_every=3, sample=2)  # fmt: skip


def test_the_sample_is_seeded_and_sized_by_fraction_or_number() -> None:
    assert sampled(0, 3, 50, 0.2) == sampled(0, 3, 50, 10)
    assert len(sampled(0, 3, 50, 0.2)) == 10 and per_round(50, 0.05) == 3
    assert sampled(0, 3, 50, 10) != sampled(0, 4, 50, 10) != sampled(1, 3, 50, 10)
    assert sampled(7, 0, 5, 1.0) == [0, 1, 2, 3, 4] and sampled(7, 0, 5, 9) == [0, 1, 2, 3, 4]
    every = [rank for r in range(200) for rank in sampled(0, r, 50, 10)]
    counts = torch.bincount(torch.tensor(every), minlength=50)
    assert int(counts.min()) >= 20 and int(counts.max()) <= 60  # about 40 each


def test_only_the_sample_trains_and_a_returning_node_gets_the_whole_model() -> None:
    grid = InProcessGrid(client_app, 6)
    s = run_job(grid, FlowerJob(SPEC))
    assert s["status"] == "completed" and s["rounds"] == 6
    rows = s["rows"]
    assert [row["sampled"] for row in rows] == [sampled(0, r, 6, 2) for r in range(6)]
    assert [row["replies"] for row in rows] == [2] * 6
    trained = [(int(m.content.config_records["fedring"]["round"]), m.metadata.dst_node_id - 100,
                str(m.content.config_records["fedring"]["kind"]))
               for m in grid.delivered if m.metadata.message_type == "train"]  # fmt: skip
    assert [(r, rank) for r, rank, _ in trained] == [
        (r, rank) for r in range(6) for rank in sampled(0, r, 6, 2)
    ]
    for r, rank, kind in trained:  # a delta only for a node that trained the round before
        back_to_back = r > 0 and rank in sampled(0, r - 1, 6, 2)
        assert kind == ("delta" if back_to_back else "none" if r == 0 else "params")
    # the dense equivalent counts only the sampled nodes' updates
    assert s["dense_equivalent_uplink_bytes_per_client"] == pytest.approx(
        s["params"] * 4 * 12 / 6
    )


def test_a_sampled_run_is_the_same_every_time() -> None:
    hashes = {run_job(InProcessGrid(client_app, 6), FlowerJob(SPEC))["model_sha256_final"]
              for _ in range(2)}  # fmt: skip
    assert len(hashes) == 1


@pytest.mark.parametrize(
    ("policy", "missed", "left"),
    [("keep", 3, 1.0), ("reset", 3, 0.0), ("decay:0.5", 3, 0.125), ("reset", 0, 1.0),
     ("decay:0.5", 0, 1.0)],
)  # fmt: skip
def test_sit_out_policy(policy: str, missed: int, left: float) -> None:
    residual = torch.ones(4)
    SitOut.parse(policy).apply(residual, missed)
    assert residual.tolist() == [left] * 4


def test_a_node_back_from_sitting_out_applies_the_policy_to_its_residual() -> None:
    """`reset`: back after 3 rounds out, the node sends what a node with no residual
    sends; back to back it keeps its residual; `keep` keeps it after sitting out."""
    p = plan(SPEC)
    state = enrol(SPEC, 0, p.manifest.sha256(), p.model_sha256, p.initial)
    state, _ = train_round(SPEC, state, 0.05, r=0)
    assert state.last_round == 0 and float(state.residual.norm()) > 0

    def sent(policy: str, r: int, zero: bool = False) -> torch.Tensor:
        s = replace(state, residual=torch.zeros_like(state.residual) if zero else
                    state.residual.clone())  # fmt: skip
        return train_round(SPEC.replace(sit_out=policy), s, 0.05, r=r)[1].payload.decompress()

    assert torch.equal(sent("reset", 4), sent("keep", 1, zero=True))
    assert torch.equal(sent("reset", 1), sent("keep", 1))  # no round missed: nothing to do
    assert not torch.equal(sent("keep", 4), sent("reset", 4))


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [({"sample": 1.5}, "'sample'=1.5 must be a fraction in (0, 1]"),
     ({"sample": 0.0}, "'sample'=0.0 must be a fraction"),
     ({"sample": 2, "topology": "ring"}, "needs a centre that sends every agent the result"),
     ({"sample": 2, "sync": "async"}, "sync='async'"),
     ({"sample": 2, "aggregation": "hybrid:0.5"}, "aggregation='hybrid:0.5'"),
     ({"sit_out": "decay:2"}, "'sit_out': 'decay:2': decay:G needs G in [0, 1]"),
     ({"sit_out": "forget"}, "'sit_out': 'forget' must be keep, reset or decay:G")],
)  # fmt: skip
def test_bad_sampling_fields_name_the_field(fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(SpecError, match=re.escape(fragment)):
        SPEC.replace(**fields)
    assert SPEC.replace(sample=6, topology="ring").sample == 6  # every agent: no sampling

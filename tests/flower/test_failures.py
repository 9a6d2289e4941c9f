"""The ServerApp's reactions to lost nodes, star and ring, on an in-process grid."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flwr.app import Message

from fedring.config import JobSpec
from fedring.flower.client_app import app as client_app
from fedring.flower.job import FlowerJob
from fedring.flower.server_app import run_job
from fedring.training.models import flat_sha256
from tests.flower.inproc_grid import InProcessGrid

SPEC = JobSpec(agents=3, dataset="digits", sync="local", local_steps=2, lr=0.05, rounds=3,
               eval_every=1)  # fmt: skip


def _ring_step(round: int, step: int) -> Any:
    def hit(msg: Message) -> bool:
        ring = msg.content.config_records.get("ring")
        return ring is not None and ring["round"] == round and ring["step"] == step

    return hit


def _train_round(round: int) -> Any:
    def hit(msg: Message) -> bool:
        cfg = msg.content.config_records.get("fedring")
        return msg.metadata.message_type == "train" and cfg is not None and cfg["round"] == round

    return hit


def _held(grid: InProcessGrid, node: int) -> torch.Tensor:
    return torch.from_numpy(
        grid.contexts[node].state.array_records["fedring.node"]["params"].numpy()
    )


def test_star_round_completed_by_the_survivors() -> None:
    grid = InProcessGrid(client_app, 3)
    grid.die_when(102, _train_round(1))
    s = run_job(grid, FlowerJob(SPEC.replace(topology="star"), round_timeout_s=1.0))
    assert s["status"] == "completed" and s["rounds"] == 3
    assert [row["replies"] for row in s["rows"]] == [3, 2, 2]
    # round 2 goes to the nodes still connected: the lost one is recorded once
    assert [(f["round"], f["rank"]) for f in s["failures"]] == [(1, 2)]


def test_star_node_that_missed_a_round_gets_the_whole_model() -> None:
    grid = InProcessGrid(client_app, 3)
    grid.lose_reply_when(101, _train_round(1))  # it trained, its reply never came
    s = run_job(grid, FlowerJob(SPEC.replace(topology="star"), round_timeout_s=1.0))
    assert s["status"] == "completed"
    assert [row["replies"] for row in s["rows"]] == [3, 2, 3]
    kinds = [m.content.config_records["fedring"]["kind"] for m in grid.delivered
             if m.metadata.dst_node_id == 101 and m.metadata.message_type == "train"]  # fmt: skip
    assert kinds == ["none", "delta", "params"]  # after the lost reply: the whole model
    # every node that answered the last round holds the ServerApp's model, bit for bit
    # (the last downlink is still to come, so they hold the model of round 2's start)
    held = {flat_sha256(_held(grid, n)) for n in (100, 101, 102)}
    assert len(held) == 1


def test_ring_is_re_formed_from_the_survivors() -> None:
    grid = InProcessGrid(client_app, 3)
    grid.die_when(102, _ring_step(round=1, step=1))  # mid reduce-scatter
    s = run_job(grid, FlowerJob(SPEC.replace(topology="ring"), round_timeout_s=1.0))
    assert s["status"] == "completed" and s["rounds"] == 3
    assert [row["replies"] for row in s["rows"]] == [3, 2, 2]
    assert [(f["round"], f["rank"], f["step"]) for f in s["failures"]] == [(1, 2, 1)]
    assert flat_sha256(_held(grid, 100)) == flat_sha256(_held(grid, 101)) == s["model_sha256_final"]
    assert s["evals"][-1]["test_loss"] < s["evals"][0]["test_loss"]


def test_ring_broken_in_its_last_step_fails_the_run() -> None:
    grid = InProcessGrid(client_app, 3)
    grid.die_when(101, _ring_step(round=1, step=4))  # 2(N-1) = 4: nodes may have applied it
    s = run_job(grid, FlowerJob(SPEC.replace(topology="ring"), round_timeout_s=1.0))
    assert s["status"].startswith("failed: round 1") and "last step" in s["status"]
    assert s["rounds"] == 1


@pytest.mark.parametrize(
    ("changes", "downlink"),
    [
        ({"aggregation": "weighted", "sharding": "quantity:1.0"}, "dense"),
        ({"aggregation": "median"}, "group-topk"),
        ({"aggregation": "trimmed:0.34"}, "dense"),
        ({"sync": "sync", "aggregation": "vote", "lr": 0.001}, "dense"),
        ({"sync": "sync"}, "group-topk"),
        ({"sync": "sync", "compression": "none"}, "dense"),
        ({"topology": "ring", "aggregation": "weighted", "sharding": "quantity:1.0"}, "dense"),
        ({"topology": "ring", "sync": "sync", "compression": "none"}, "dense"),
    ],
)
def test_every_rule_runs_and_every_node_holds_the_same_bits(
    changes: dict[str, Any], downlink: str
) -> None:
    spec = SPEC.replace(**{"topology": "star", **changes})
    grid = InProcessGrid(client_app, 3)
    s = run_job(grid, FlowerJob(spec, downlink=downlink, round_timeout_s=1.0))
    assert s["status"] == "completed" and s["failures"] == [], s["status"]
    assert s["evals"][-1]["test_loss"] < s["evals"][0]["test_loss"] + 0.05
    held = {flat_sha256(_held(grid, n)) for n in grid.contexts}
    assert len(held) == 1  # the sha256 check in every message kept the nodes identical


def _own(grid: InProcessGrid, node: int) -> torch.Tensor:
    return torch.from_numpy(
        grid.contexts[node].state.array_records["fedring.node"]["personal"].numpy()
    )


def test_hybrid_keeps_an_own_model_per_node_and_reports_their_mean_accuracy() -> None:
    spec = SPEC.replace(topology="star", rounds=6, eval_every=3)
    grid = InProcessGrid(client_app, 3)
    s = run_job(grid, FlowerJob(spec.replace(aggregation="hybrid:0.5")))
    assert s["status"] == "completed" and s["rounds"] == 6
    final = s["evals"][-1]
    assert final["own_models"] == 3 and 0.0 < final["accuracy"] <= 1.0
    assert s["final_accuracy"] == final["accuracy"] != final["global_accuracy"]
    own = {flat_sha256(_own(grid, n)) for n in (100, 101, 102)}
    assert len(own) == 3  # lambda < 1: each node keeps some of its own moves
    held = {flat_sha256(_held(grid, n)) for n in (100, 101, 102)}
    assert held == {s["model_sha256_final"]}  # the global model is still shared exactly

    # lambda = 1 takes only the global move: every own model is the global model, and
    # the global model is the one plain `mean` gives.
    grid = InProcessGrid(client_app, 3)
    one = run_job(grid, FlowerJob(spec.replace(aggregation="hybrid:1.0")))
    mean = run_job(InProcessGrid(client_app, 3), FlowerJob(spec))
    assert one["model_sha256_final"] == mean["model_sha256_final"]
    assert {flat_sha256(_own(grid, n)) for n in (100, 101, 102)} == {mean["model_sha256_final"]}
    assert one["final_accuracy"] == pytest.approx(mean["final_accuracy"])

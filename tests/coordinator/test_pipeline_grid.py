"""The S x D grid's bookkeeping: who holds what, which boards plan a stage, each
replica's shard checked against the coordinator's entry, replicas that disagree."""

from __future__ import annotations

import pytest
import torch

from fedring.coordinator.byes import MAX_COUNTERS, read_counters
from fedring.coordinator.pipeline_grid import (
    Grid,
    replicas_differ,
    shard_entries,
    stage_boards,
)
from fedring.pipeline.assignment import shard_of
from fedring.pipeline.partition import Board
from fedring.training.datasets import load_dataset
from fedring.training.sharding import ShardError, make_shards


def test_members_are_laid_out_stage_by_stage() -> None:
    grid = Grid(["a0", "a1", "a2", "a3", "a4", "a5"], stages=3)
    assert grid.replicas == 2
    assert [grid.at(s, d) for s in range(3) for d in range(2)] == grid.members
    assert grid.where("a5") == (2, 1) and grid.where("zz") == (-1, -1)
    assert grid.who(2) == "stage 1 replica 0 (agent a2)"
    assert Grid(["a0", "a1"], stages=2).who(1) == "stage 1 (agent a1)"  # D = 1: as before


def test_a_stage_is_planned_on_its_slowest_and_smallest_board() -> None:
    boards = [Board("pi3", 2.0, 400), Board("pi4", 6.0, 900), Board("pi4", 6.0, 900),
              Board("pi5", 9.0, 1800)]  # fmt: skip
    got = stage_boards(boards, 2)
    assert got == [Board("pi3+pi4", 2.0, 400), Board("pi4+pi5", 6.0, 900)]
    assert stage_boards(boards, 4) == boards


def test_each_replica_gets_its_own_shard_checked_by_sha256() -> None:
    data = load_dataset("digits", seed=0)
    entries = shard_entries(data, 2, "iid", 0)
    assert shard_entries(data, 1, "iid", 0) == []
    x0, _ = shard_of(data, entries[0], 0, 2, scheme="iid", seed=0)
    x1, y1 = shard_of(data, entries[1], 1, 2, scheme="iid", seed=0)
    assert x0 is not None and x1 is not None and y1 is not None
    index = make_shards(data.y_train.numpy(), 2, "iid", 0)[1]
    assert torch.equal(x1, data.x_train[torch.from_numpy(index)])
    assert len(x0) + len(x1) == len(data.x_train)
    with pytest.raises(ShardError):  # another replica's entry
        shard_of(data, entries[0], 1, 2, scheme="iid", seed=0)
    with pytest.raises(ShardError):  # another sharding than the coordinator's
        shard_of(data, entries[1], 1, 2, scheme="iid", seed=1)
    assert shard_of(data, None, 0, 1, scheme="iid", seed=0) == (None, None)


def test_replicas_that_disagree_are_named() -> None:
    grid = Grid(["a0", "a1", "a2", "a3"], stages=2)
    same = {0: {"sha256": "x"}, 1: {"sha256": "x"}, 2: {"sha256": "y"}, 3: {"sha256": "y"}}
    assert replicas_differ(grid, same) == ""
    why = replicas_differ(grid, {**same, 3: {"sha256": "z"}})
    assert "stage 1" in why and "a3" in why


def test_a_measured_split_is_refused_before_the_broker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The coordinator plans on PyTorch's meta device: it counts, it cannot time."""
    from fedring.config import JobSpec
    from fedring.coordinator.pipeline import PipelineCoordinator, PipelineError
    from fedring.coordinator.service import Options
    from fedring.transport.mqtt import BrokerConfig

    spec = JobSpec(agents=2, pipeline_stages=2, pipeline_cost="measured")
    coord = PipelineCoordinator(spec, BrokerConfig.parse("mqtt://127.0.0.1:9"), Options(tmp_path))
    with pytest.raises(PipelineError, match=r"'pipeline_cost'='measured'"):
        coord.run()
    assert coord.counters.get("pipeline_refused") == 1


def test_a_byes_counters_are_taken_as_sent_or_absent() -> None:
    sent = {"pp-act_sent": 40, "frame_bad_mac": 0, "x" * 64: 2**63}
    assert read_counters({"counters": sent}).counters == sent
    assert read_counters({"counters": sent}).refused == ""
    assert read_counters({"sha256": "ab"}) == read_counters({"counters": {}})  # an older agent
    assert read_counters({}).counters == {} and read_counters({}).refused == ""


@pytest.mark.parametrize(
    ("counters", "fragment"),
    [
        ([["a", 1]], "field 'counters' = [['a', 1]]: not an object"),
        ("x" * 10_000, "field 'counters' = '" + "x" * 59 + ": not an object"),
        ({"duplicate": -1}, "entry 'duplicate' = -1: not a non-negative integer"),
        ({"duplicate": True}, "entry 'duplicate' = True: not a non-negative"),
        ({"duplicate": 1.5}, "entry 'duplicate' = 1.5: not a non-negative"),
        ({"duplicate": "3"}, "entry 'duplicate' = '3': not a non-negative"),
        ({"duplicate": {"n": 1}}, "entry 'duplicate' = {'n': 1}: not a non-negative"),
        ({"": 1}, "name '': not a string of 1 to 64 characters"),
        ({"y" * 65: 1}, "name '" + "y" * 65 + "': not a string of 1 to 64"),
        ({3: 1}, "name 3: not a string"),
        ({f"c{i}": 1 for i in range(MAX_COUNTERS + 1)}, "has 513 names, more than 512"),
    ],
    ids=["list", "huge-string", "negative", "bool", "float", "string", "object", "empty-name",
         "long-name", "int-name", "too-many"],
)  # fmt: skip
def test_a_malformed_counters_object_is_refused_whole_naming_the_field(
    counters: object, fragment: str
) -> None:
    got = read_counters({"counters": counters, "sha256": "ab"})
    assert got.counters == {}
    assert fragment in got.refused, got.refused
    assert len(got.refused) < 200  # a megabyte's value is not copied into the log

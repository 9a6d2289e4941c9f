"""Who sends the coordinator what at a checkpoint (`edge_agent.checkpoint_stream`)."""

from __future__ import annotations

import numpy as np
import torch

from fedring.edge_agent.checkpoint_stream import CheckpointStream, whole_only
from fedring.training.models import flat_sha256
from fedring.wire.patch import apply_patch


def test_the_members_other_than_the_head_split_the_model_between_them() -> None:
    members = ["h", "a", "b", "c"]
    spans = [CheckpointStream(m, members, 10, dense=False) for m in members]
    assert not spans[0].patcher and spans[0].head
    parts = [s.span for s in spans[1:]]
    assert parts == [(0, 3), (3, 6), (6, 10)]  # the whole vector, once
    solo = CheckpointStream("h", ["h"], 10, dense=False)
    assert solo.patcher and solo.span == (0, 10)


def test_the_head_uploads_whole_first_and_the_members_patch_from_there() -> None:
    members = ["h", "a", "b"]
    head, *rest = (CheckpointStream(m, members, 6, dense=False) for m in members)
    params = torch.arange(6, dtype=torch.float32)
    assert head.dense_due()
    assert all(s.checkpoint(1, params, 0) is None for s in (head, *rest))  # the bases
    assert not head.dense_due()
    new = params.clone()
    new[[1, 4]] = -1.0
    copy = params.numpy().copy()
    for s in rest:
        got = s.checkpoint(2, new, 0)
        assert got is not None
        doc, blob = got
        assert (doc["round"], doc["from"], doc["sha256"]) == (2, 1, flat_sha256(new))
        apply_patch(copy, doc, blob)
    assert np.array_equal(copy, new.numpy())


def test_a_mixed_ring_keeps_the_heads_whole_uploads() -> None:
    members = ["h", "a"]
    head, other = (CheckpointStream(m, members, 4, dense=True) for m in members)
    for r in (1, 2):
        assert head.dense_due() and head.checkpoint(r, torch.zeros(4), 0) is None
        assert other.checkpoint(r, torch.zeros(4), 0) is None


def test_members_that_differ_by_design_keep_the_whole_uploads() -> None:
    assert whole_only("mean", mixed=True) and whole_only("hybrid:0.5", mixed=False)
    assert not whole_only("mean", mixed=False) and not whole_only("median", mixed=False)

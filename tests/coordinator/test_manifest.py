"""A segment's manifests: each member's row of the shard table, and no pass over the
whole table (or the whole model) per member (issue 29: N^2 at 1,000 members)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from fedring.config import JobSpec
from fedring.coordinator import checkpoint
from fedring.coordinator.checkpoint import Checkpoint
from fedring.coordinator.manifest import segment_docs, shard_entries
from fedring.training.sharding import ShardError, ShardManifest


def _checkpoint(n: int) -> tuple[Checkpoint, list[str], ShardManifest]:
    digests = tuple(hashlib.sha256(str(i).encode()).hexdigest() for i in range(n))
    table = ShardManifest("synthetic:20000:32:4", "iid", 0, n, tuple(range(10, 10 + n)), digests)
    members = [f"a{i:04d}" for i in range(n)]
    spec = JobSpec.from_mapping({"agents": n, "topology": "star"}).resolved()
    ck = Checkpoint(job="j", key=bytes(32), spec=spec, shards={m: n - 1 - i for i, m in
                    enumerate(members)}, model_sha256="0" * 64, shard_manifest=table.to_dict(),
                    epoch=0, round=0, params=torch.arange(100, dtype=torch.float32))  # fmt: skip
    return ck, members, table


@pytest.mark.parametrize("n", [1, 10, 300])
def test_the_table_and_the_model_are_hashed_once_a_segment(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck, members, table = _checkpoint(n)
    calls = {"table": 0, "model": 0}
    table_sha, model_sha = ShardManifest.sha256, checkpoint.flat_sha256

    def count_table(self: ShardManifest) -> str:
        calls["table"] += 1
        return table_sha(self)

    def count_model(flat: torch.Tensor) -> str:
        calls["model"] += 1
        return model_sha(flat)

    monkeypatch.setattr(ShardManifest, "sha256", count_table)
    monkeypatch.setattr(checkpoint, "flat_sha256", count_model)
    docs = segment_docs(ck, members, 0, 0, 0)
    assert calls == {"table": 1, "model": 1}  # was N of each
    monkeypatch.undo()
    assert list(docs) == members
    for agent, doc in docs.items():  # what `ShardManifest.entry` gives, row for row
        assert doc["shard_entry"] == table.entry(ck.shards[agent]).to_dict()
        assert doc["params_sha256"] == ck.params_sha256


def test_a_rank_outside_the_table_is_refused_as_entry_refuses_it() -> None:
    _, _, table = _checkpoint(3)
    entry = shard_entries(table)
    for bad in (-1, 3, True, "1"):
        with pytest.raises(ShardError, match=r"rank .* out of range 0\.\.2"):
            entry(bad)  # type: ignore[arg-type]
        with pytest.raises(ShardError, match=r"rank .* out of range 0\.\.2"):
            table.entry(bad)  # type: ignore[arg-type]

"""Checkpoints are read with torch.load(weights_only=True) and refused with one clear
CheckpointError: garbage, a torch file that is not a checkpoint, tampered parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedring.coordinator.checkpoint import FILE, Checkpoint, CheckpointError


def _checkpoint() -> Checkpoint:
    return Checkpoint(job="j", key=b"k" * 32, spec={"agents": 2}, shards={"a0": 0, "a1": 1},
                      model_sha256="0" * 64, shard_manifest={}, epoch=1, round=3,
                      params=torch.arange(4.0), events=[{"t": 1.0, "epoch": 0, "why": "x"}],
                      wall_s=2.5)  # fmt: skip


def test_a_saved_checkpoint_loads_back_with_its_history(tmp_path: Path) -> None:
    _checkpoint().save(tmp_path)
    ck = Checkpoint.load(tmp_path)
    assert ck.round == 3 and torch.equal(ck.params, torch.arange(4.0))  # type: ignore[arg-type]
    assert ck.events == [{"t": 1.0, "epoch": 0, "why": "x"}] and ck.wall_s == 2.5


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (bytes(range(256)) * 4, "not a fedring checkpoint"),
        (None, "unreadable: KeyError"),  # a torch file, but not a checkpoint's fields
    ],
)
def test_what_is_not_a_checkpoint_is_refused(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    if content is None:
        torch.save({"params": torch.zeros(2)}, tmp_path / FILE)
    else:
        (tmp_path / FILE).write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        Checkpoint.load(tmp_path)


def test_tampered_parameters_are_refused(tmp_path: Path) -> None:
    path = _checkpoint().save(tmp_path)
    state = torch.load(path, weights_only=True)
    state["params"][0] += 1.0
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="do not match their sha256"):
        Checkpoint.load(tmp_path)

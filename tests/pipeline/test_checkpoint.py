"""Checkpoint and resume per stage: a resumed grid ends bit for bit where an unbroken one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedring.engine.reducer import ReducerSettings
from fedring.engine.sampler import ShardSampler
from fedring.pipeline.checkpoint import CheckpointMismatch, load_grid, save_grid
from fedring.pipeline.grid import GridWorker, PipelineSettings, ShardBatches, build_grid, run_steps
from fedring.training.models import params_sha256
from fedring.transport.inproc import InprocTransport
from tests.pipeline.test_equivalence import model_of, plan_for

GEN = torch.Generator().manual_seed(5)
X, Y = torch.randn(64, 6, generator=GEN), torch.randint(0, 3, (64,), generator=GEN)


def grid_and_hub() -> tuple[list[list[GridWorker]], InprocTransport]:
    model = model_of(6, 11)  # the same start every time
    hub = InprocTransport(cooperative=True)
    grid = build_grid(
        list(model), plan_for(model, [0, 3], 2, "1f1b"), 2, PipelineSettings(2, "1f1b"),
        loss_fn=F.cross_entropy,
        make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        reducer_settings=ReducerSettings(density=0.1, group_size=16, density_warmup=2),
        data=lambda d: ShardBatches(X[d::2], Y[d::2], ShardSampler(32, batch_size=8, seed=0,
                                                                    rank=d)),
        hub=hub,
    )  # fmt: skip
    return grid, hub


def hashes(grid: list[list[GridWorker]]) -> list[str]:
    return [params_sha256(w.stage.module) for row in grid for w in row]


def test_resume_from_a_stage_checkpoint_gives_the_unbroken_run(tmp_path: Path) -> None:
    whole, hub = grid_and_hub()
    run_steps(whole, start=0, steps=8, lr_at=lambda s: 0.05, hub=hub)
    first, hub = grid_and_hub()
    run_steps(first, start=0, steps=5, lr_at=lambda s: 0.05, hub=hub)
    paths = save_grid(first, tmp_path, step=5)
    assert sorted(p.name for p in paths) == ["stage0-r0.pt", "stage0-r1.pt", "stage1-r0.pt",
                                              "stage1-r1.pt"]  # fmt: skip
    resumed, hub = grid_and_hub()
    start = load_grid(resumed, tmp_path)
    assert start == 5
    run_steps(resumed, start=start, steps=3, lr_at=lambda s: 0.05, hub=hub)
    assert hashes(resumed) == hashes(whole)
    fresh, hub = grid_and_hub()  # the test can fail: without the residual and momentum
    run_steps(fresh, start=5, steps=3, lr_at=lambda s: 0.05, hub=hub)
    assert hashes(fresh) != hashes(whole)


def test_a_file_of_another_stage_or_a_missing_one_is_refused_by_name(tmp_path: Path) -> None:
    grid, _ = grid_and_hub()
    save_grid(grid, tmp_path, step=0)
    (tmp_path / "stage0-r1.pt").write_bytes((tmp_path / "stage1-r1.pt").read_bytes())
    with pytest.raises(CheckpointMismatch, match=r"stage0-r1\.pt: \(version, stage, replica\) "
                       r"= \(1, 1, 1\), this worker is \(1, 0, 1\)"):  # fmt: skip
        load_grid(grid, tmp_path)
    save_grid(grid, tmp_path / "other", step=0)
    (tmp_path / "other" / "stage1-r0.pt").unlink()
    missing = r"no checkpoint .*stage1-r0\.pt. for stage 1 replica 0"
    with pytest.raises(CheckpointMismatch, match=missing):
        load_grid(grid, tmp_path / "other")

"""The examples run and show what they claim."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_ring_allreduce_example_loses_nothing() -> None:
    module = runpy.run_path(str(EXAMPLES / "ring_allreduce.py"))
    gap = module["main"](numel=20_000, steps=3)
    assert gap < 1e-5  # everything not yet sent is still in some residual


def test_the_pipeline_job_file_is_valid_and_its_split_fits_three_pi3s() -> None:
    from fedring.config import JobSpec
    from fedring.firmware_profiles.schema import load_builtin
    from fedring.pipeline.assignment import plan_from_shapes
    from fedring.pipeline.materialize import meta_layers
    from fedring.pipeline.partition import Board

    spec = JobSpec.from_toml(EXAMPLES / "pipeline.toml")
    assert spec.pipeline_stages == spec.agents == 3
    pi3 = load_builtin("rpi3")
    layers = meta_layers(spec.model, (1, 8, 8), 10)
    total = sum(p.numel() for layer in layers for p in layer.parameters())
    assert total * 4 * 24 > 2 * pi3.ram_budget_mb * 2**20  # no Pi 3 holds it whole
    plan = plan_from_shapes(
        layers, (1, 8, 8), [Board.of(pi3)] * 3, batch_size=spec.batch_size,
        micro_batches=spec.micro_batches, schedule=spec.pipeline_schedule,
    )  # fmt: skip
    assert len(plan.stages) == 3

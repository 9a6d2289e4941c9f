"""A user's own script (examples/own_model.py) trains through the public engine: its own
model with BatchNorm, MSE loss, AdamW and DataLoaders, four agents on threads."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_model.py"
STEPS = 200  # the example's default: the tolerance it states holds there


@pytest.fixture(scope="module")
def example() -> dict[str, Any]:
    return runpy.run_path(str(EXAMPLE))


@pytest.fixture(scope="module")
def runs(example: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: example["main"](dense=kind == "dense", steps=STEPS, seed=0)
            for kind in ("dense", "compressed")}  # fmt: skip


def test_every_agent_ends_with_the_same_parameters(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["dense"]["identical"]
    assert runs["compressed"]["identical"]


def test_compressed_r2_is_within_the_stated_tolerance_of_dense(
    example: dict[str, Any], runs: dict[str, dict[str, Any]]
) -> None:
    dense, sparse = runs["dense"], runs["compressed"]
    assert sparse["r2"] >= dense["r2"] - example["R2_TOLERANCE"]
    assert dense["r2"] > 0.3 and sparse["r2"] > 0.3  # both learnt: untrained is about -0.1
    assert sparse["test_mse"] < 0.6 * sparse["initial_mse"]


def test_compression_sends_fewer_bytes(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["compressed"]["bytes_sent_per_agent"] < 0.5 * runs["dense"]["bytes_sent_per_agent"]

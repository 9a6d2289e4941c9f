"""The public API composes into exactly the product: a user's own loop over
`fedring.plan`, `local_group`, `Reducer`, `DistributedOptimizer`, `LinearScaling` and
`ShardSampler` (examples/library_digits.py) ends with `fedring simulate`'s parameters.
tests/mqtt/test_job.py checks the same for the MQTT daemons, on the 95% job."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from fedring.config import JobSpec
from fedring.sim.runner import simulate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "library_digits.py"


@pytest.mark.parametrize("rounds", [1, 60])  # inside and past the warm-ups (50 lr, 10 density)
def test_library_loop_gives_the_simulator_hash(rounds: int) -> None:
    library = runpy.run_path(str(EXAMPLE))["main"](rounds=rounds, target=2.0)  # no early stop
    [expected] = simulate(JobSpec(rounds=rounds))["model_hashes"]
    assert library["hashes"] == [expected]


def test_a_different_seed_gives_a_different_hash() -> None:
    """The comparison above can fail: the hash depends on the training it summarises."""
    library = runpy.run_path(str(EXAMPLE))["main"](rounds=5, target=2.0)
    assert library["hashes"] != simulate(JobSpec(rounds=5, seed=1))["model_hashes"]
